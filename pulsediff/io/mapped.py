"""Memory-mapped inputs that may shrink while they are read, without dying of SIGBUS.

Checkpoints are read through memory maps (checkpoint.py): zero copies, and
the pages stay page cache, not private memory. But when a mapped file
shrinks (a trainer overwriting its checkpoint, a sync tool replacing it in
place, a full disk), touching a page past its new end raises SIGBUS, which
kills the process: Python cannot handle a fault raised inside native code
(a Numba kernel, a hash), since its handlers run later, between bytecodes.

So a handler in machine code does, installed with sigaction on first use:
for a fault past the end of a file (si_code BUS_ADRERR) inside a range
registered here, it maps zero pages over the rest of that range
(MAP_FIXED, anonymous), counts the fault against the range, and returns;
the faulting load runs again and reads zeros. Any other SIGBUS (an address
outside every range, an alignment or hardware error, one sent by kill)
gets back the action that was there before (the default, or
faulthandler's) and meets it: the process dies of it as before. Readers then learn of the
change before anything they computed is trusted: `check()` raises
`CheckpointChangedError`, naming the file, when a range has faulted, and
is called before an output is committed (atomic.StagedFiles.commit), before
a patch goes to stdout or a stream, and when a checkpoint is closed at the
end of a `with` block (so digest and stats never print what zeros gave).

Why not read with pread into buffers instead: on the benchmark VM, make and
apply then hold their tensors in flight in private memory (about 1 GiB for
the 1 GiB pair's two 250 MiB tensors, base and target, two at once), and
fresh memory costs 0.6 to 1.6 s per GiB there: make took 2.8x as long,
apply 1.18x (issue 23; figures in the commit that added this module).

The handler is a few lines of LLVM IR compiled by llvmlite (Numba's own
compiler; about 7 ms), so that it needs neither the GIL nor a C compiler.
It is installed on Linux on x86-64 and AArch64 (where siginfo's layout and
the mmap flags below hold); elsewhere, or if compiling fails, nothing is
installed and a shrinking input still kills the process, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import threading

from pulsediff.errors import CheckpointChangedError, CheckpointReadError

SLOTS = 1024  # ranges watched at once: one per mapped file of the open checkpoints

_SIGBUS = 7  # Linux's number on x86-64 and AArch64
_SIGACTION_BYTES = 152  # sizeof(struct sigaction) in glibc on x86-64 and AArch64 (see _SigAction)
_SA_SIGINFO = 4
_BUS_ADRERR = 2
_PROT_READ = 1
_MAP_PRIVATE_FIXED_ANONYMOUS = 0x02 | 0x10 | 0x20


def _ir(page: int, opaque: bool) -> str:
    p = "ptr" if opaque else "i8*"
    p64 = "ptr" if opaque else "i64*"
    p32 = "ptr" if opaque else "i32*"
    cast = (lambda v, t: "") if opaque else (lambda v, t: f"  %{v}c = bitcast i8* %{v} to {t}\n")
    suffix = "" if opaque else "c"
    return f"""
@ranges = global [{2 * SLOTS} x i64] zeroinitializer
@faulted = global [{SLOTS} x i64] zeroinitializer
@oldaction = global [{_SIGACTION_BYTES} x i8] zeroinitializer
declare {p} @mmap({p}, i64, i32, i32, i32, i64)
declare i32 @sigaction(i32, {p}, {p})
declare i32 @raise(i32)

define void @pulsediff_on_sigbus(i32 %sig, {p} %info, {p} %ctx) {{
entry:
  %codep = getelementptr i8, {p} %info, i64 8
{cast("codep", p32)}  %code = load volatile i32, {p32} %codep{suffix}
  %addrp = getelementptr i8, {p} %info, i64 16
{cast("addrp", p64)}  %addr = load volatile i64, {p64} %addrp{suffix}
  %isadr = icmp eq i32 %code, {_BUS_ADRERR}
  br i1 %isadr, label %loop, label %fatal
loop:
  %i = phi i64 [0, %entry], [%next, %cont]
  %si = mul i64 %i, 2
  %sp = getelementptr [{2 * SLOTS} x i64], {"ptr" if opaque else f"[{2 * SLOTS} x i64]*"} @ranges, i64 0, i64 %si
  %start = load volatile i64, {p64} %sp
  %ei = add i64 %si, 1
  %ep = getelementptr [{2 * SLOTS} x i64], {"ptr" if opaque else f"[{2 * SLOTS} x i64]*"} @ranges, i64 0, i64 %ei
  %end = load volatile i64, {p64} %ep
  %ge = icmp uge i64 %addr, %start
  %lt = icmp ult i64 %addr, %end
  %in = and i1 %ge, %lt
  br i1 %in, label %patch, label %cont
cont:
  %next = add i64 %i, 1
  %done = icmp eq i64 %next, {SLOTS}
  br i1 %done, label %fatal, label %loop
patch:
  %page = and i64 %addr, {-page}
  %last = add i64 %end, {page - 1}
  %stop = and i64 %last, {-page}
  %len = sub i64 %stop, %page
  %pp = inttoptr i64 %page to {p}
  %r = call {p} @mmap({p} %pp, i64 %len, i32 {_PROT_READ}, i32 {_MAP_PRIVATE_FIXED_ANONYMOUS}, i32 -1, i64 0)
  %ri = ptrtoint {p} %r to i64
  %ok = icmp eq i64 %ri, %page
  br i1 %ok, label %count, label %fatal
count:
  %fp = getelementptr [{SLOTS} x i64], {"ptr" if opaque else f"[{SLOTS} x i64]*"} @faulted, i64 0, i64 %i
  %old = atomicrmw add {p64} %fp, i64 1 seq_cst
  ret void
fatal:
  %oa = getelementptr [{_SIGACTION_BYTES} x i8], {"ptr" if opaque else f"[{_SIGACTION_BYTES} x i8]*"} @oldaction, i64 0, i64 0
  %d = call i32 @sigaction(i32 {_SIGBUS}, {p} %oa, {p} null)
  %sent = icmp sle i32 %code, 0
  br i1 %sent, label %again, label %out
again:
  %r2 = call i32 @raise(i32 {_SIGBUS})
  ret void
out:
  ret void
}}
"""


class _SigAction(ctypes.Structure):
    # glibc's struct sigaction on x86-64 and AArch64
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_uint8 * 128), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A fork while another thread held the lock (compiling the handler takes milliseconds under
    # it) would leave it held in the child for good. The handler and its ranges are inherited as
    # they are: the child's maps are the parent's.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_state = None  # (engine, ranges, faulted) once installed; False where it cannot be
_paths: dict[int, tuple] = {}  # slot -> (path, size when mapped, (device, inode, mtime) when mapped or None)
_retired: set[int] = set()  # slots of checkpoints closed while a view was alive: guarded, never checked


def _install():
    global _state
    if _state is not None:
        return _state
    _state = False
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")):
        return _state
    try:
        import llvmlite.binding as ll

        ll.initialize_native_target()
        ll.initialize_native_asmprinter()
        libc = ctypes.CDLL(None, use_errno=True)
        for name in ("mmap", "sigaction", "raise"):
            ll.add_symbol(name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
        module = _parse(ll)
        machine = ll.Target.from_default_triple().create_target_machine()
        engine = ll.create_mcjit_compiler(module, machine)
        engine.finalize_object()
        ranges = (ctypes.c_uint64 * (2 * SLOTS)).from_address(engine.get_global_value_address("ranges"))
        faulted = (ctypes.c_uint64 * SLOTS).from_address(engine.get_global_value_address("faulted"))
        action = _SigAction()
        action.handler = engine.get_function_address("pulsediff_on_sigbus")
        action.flags = _SA_SIGINFO
        # The action this replaces goes straight into the handler's @oldaction: a SIGBUS that is
        # not ours gets it back (the default, or faulthandler's) and meets it again.
        if libc.sigaction(_SIGBUS, ctypes.byref(action), ctypes.c_void_p(engine.get_global_value_address(
                "oldaction"))) != 0:
            return _state
    except Exception:  # no llvmlite, or one that cannot compile: unprotected, as before
        return _state
    _state = (engine, ranges, faulted)  # the engine owns the handler's code: kept for the process's life
    return _state


def _parse(ll):
    """The handler's module in the pointer style this LLVM reads: opaque `ptr` (LLVM 17 knows no
    other), else typed pointers (LLVM 15 and 16 take `ptr` only in a mode llvmlite may not set)."""
    first = ll.llvm_version_info[0] >= 17
    try:
        module = ll.parse_assembly(_ir(mmap.PAGESIZE, first))
    except RuntimeError:
        module = ll.parse_assembly(_ir(mmap.PAGESIZE, not first))
    module.verify()
    return module


def watch(address: int, length: int, path: str, size: int, identity: tuple | None = None) -> int | None:
    """Guard [address, address + length), the mapping of file `path` (`size` bytes when mapped;
    `identity`, its (st_dev, st_ino, st_mtime_ns) then, lets `changed` also see a file written
    over in place without shrinking). Returns the slot to give `unwatch` and `changed`, or None
    where nothing can guard it."""
    if length <= 0:
        return None
    with _lock:
        state = _install()
        if not state:
            return None
        _, ranges, faulted = state
        # A slot over any of these addresses is stale: the kernel maps nothing over a live mapping,
        # so that one is gone (its map closed late, by the garbage collector). Left, the handler
        # could take it first and map zeros to its old end, over whatever lies there now.
        for stale in [s for s in _paths if ranges[2 * s] < address + length and address < ranges[2 * s + 1]]:
            ranges[2 * stale + 1] = 0
            ranges[2 * stale] = 0
            del _paths[stale]
            _retired.discard(stale)
        slot = next((s for s in range(SLOTS) if s not in _paths), None)
        if slot is None:
            return None  # more mapped files than slots: the rest unguarded
        faulted[slot] = 0
        # Plain stores, in this order, so that a handler never sees a range reaching past this map.
        # A CPU that reorders stores (AArch64) could show another core a start before its end; but
        # no other thread reads this map before its address reaches it through a lock or a queue,
        # whose release and acquire order these stores before that read. A fault in the window
        # would need a read of an address nobody was given yet.
        ranges[2 * slot] = 0  # empty while its end is written: the handler may read at any moment
        ranges[2 * slot + 1] = address + length
        ranges[2 * slot] = address
        _paths[slot] = (path, size, identity)
        return slot


def unwatch(slot: int | None) -> None:
    """The mapping is about to be unmapped: stop guarding it."""
    if slot is None:
        return
    with _lock:
        _, ranges, _ = _state
        ranges[2 * slot + 1] = 0
        ranges[2 * slot] = 0
        _paths.pop(slot, None)
        _retired.discard(slot)


def retire(slot: int | None) -> None:
    """The checkpoint that mapped `slot` is closed but a view keeps the map alive: go on guarding the
    range (a read through the view must not die of SIGBUS) but leave it out of `check`."""
    if slot is None:
        return
    with _lock:
        if slot in _paths:
            _retired.add(slot)


def changed(slot: int | None) -> "CheckpointChangedError | CheckpointReadError | None":
    """The error to raise if part of the file in `slot` could not be read through its mapping (it
    shrank, or a page failed to read), else None."""
    if slot is None or not _state:
        return None
    path, size, identity = _paths.get(slot, ("<unknown file>", 0, None))
    if not _state[2][slot]:
        return _written_over(path, size, identity)
    try:
        now = os.stat(path).st_size
    except OSError as exc:
        return CheckpointChangedError(path, f"{exc.strerror or exc} (it had {size:,} bytes when opened)")
    if now < size:
        return CheckpointChangedError(path, f"it is now {now:,} bytes, of the {size:,} it had when opened")
    return CheckpointReadError(path, "part of it could not be read through its mapping (an I/O error, or "
                                     "the file was cut short and written again meanwhile)")


def _written_over(path: str, size: int, identity: tuple | None) -> "CheckpointChangedError | None":
    """The same file (device and inode) with another size or modification time than when it was
    mapped: written in place while it was read, so what was read may mix old and new bytes. A file
    replaced by a rename is another inode: the mapping still reads the old one, whole."""
    if identity is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None  # gone (renamed away, deleted): the mapping still holds the old file whole
    if (st.st_dev, st.st_ino) != identity[:2] or (st.st_size, st.st_mtime_ns) == (size, identity[2]):
        return None
    if st.st_size < size:  # cut short, but no page past the new end was touched (yet)
        return CheckpointChangedError(path, f"it is now {st.st_size:,} bytes, of the {size:,} it had when opened")
    return CheckpointChangedError(path, "it was written to in place (its size or modification time "
                                        "changed)")


def check() -> None:
    """Raise CheckpointChangedError (or CheckpointReadError) if part of a file mapped now could not be
    read through its mapping. Called before results are committed or sent."""
    if not _state:
        return
    with _lock:
        slots = [s for s in _paths if s not in _retired]
    for slot in slots:
        err = changed(slot)
        if err is not None:
            raise err
