"""What pulsediff writes, as docs/FORMAT.md specifies it: the patch container (container), its
validated header (header), a patch file or a chain of them opened and checked (patch_file),
checkpoint and tensor digests (digest), and a series' manifest (manifest). Bytes in, checked
records out; no operation lives here."""
