"""A local HTTP server that serves a folder and fails chosen GETs, for tests of remote series
(tests/test_remote.py) and the remote trials of scripts/fuzz_campaign.py."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

FAULTS = ("500", "404", "reset", "flip")


class FaultServer:
    """http.server over `root`. `fault_of(path)` says what each GET gets: "ok" (the file), "500" or
    "404" (that error), "reset" (headers that promise the whole file, half of it, then the connection
    goes) or "flip" (the whole file with one byte flipped). `served` counts the answers given."""

    def __init__(self, root: Path, fault_of: Callable[[str], str]):
        lock = threading.Lock()
        self.served = Counter()
        outer = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                with lock:
                    fault = fault_of(self.path)
                    outer.served[fault] += 1
                if fault == "ok":
                    return super().do_GET()
                if fault in ("500", "404"):
                    self.send_error(int(fault))
                    return
                data = bytearray((root / self.path.lstrip("/")).read_bytes())
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "flip":
                    data[len(data) // 2] ^= 0x40
                    self.wfile.write(bytes(data))
                    return
                self.wfile.write(bytes(data[: len(data) // 2]))  # "reset"
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a client that hung up on a fault: expected
                pass

        self.httpd = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
