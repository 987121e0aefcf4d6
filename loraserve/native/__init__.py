"""The package's native kernels' shared machinery: the C build and load (`build`), the SIMD header the
C kernels share (`simd.h`), huge-page buffers (`huge_pages`) and the optional Triton modules (`optional`)."""
