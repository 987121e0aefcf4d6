"""The package's hand-written C kernels' shared build and load machinery."""
