"""Plain-PyTorch versions of every transfuse op: the oracle the tests compare kernels against."""
