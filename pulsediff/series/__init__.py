"""Series of checkpoints, distributed: finding a trainer's checkpoints (steps), publishing
patches and a manifest (publish), following them on a worker, as files or live tensors
(catch_up), where a series lives (store: the contract and a folder; remote: s3://, http(s)://
and open_store), signed manifests (signing), and series statistics (stats)."""
