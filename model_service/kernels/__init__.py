"""Native CPU kernels (C, built when kvserve is installed) and the oneDNN ops: the bottom of the
model service, below attention and the model. Nothing here imports the rest of kvserve."""
