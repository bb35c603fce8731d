"""Worker processes: spawning and signalling, their environment, their output, the disk
reserve, the guardian."""
