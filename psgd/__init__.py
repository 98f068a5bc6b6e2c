"""psgd: sharded parameter-server training for PyTorch, with five consistency modes."""
__version__ = "0.1.0"
