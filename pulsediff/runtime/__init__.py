"""Process-wide plumbing every layer may use: deferring Ctrl-C around commits (interrupt),
one-line notices on stderr (notices), and the progress protocol operations report through
(progress). Nothing here knows checkpoints or patches."""
