"""Reading and writing checkpoints: the strict safetensors header parser (safetensors_header),
checkpoints and model folders as mapped tensor views (checkpoint, folder_files, dtypes),
buffers and page-fault-free reads (memory), the SIGBUS guard over mapped inputs (mapped),
all-or-nothing output files (atomic) and the strict JSON reader the headers use (strict_json).
Knows nothing of patches."""
