"""CPU emulation of servesim's CUDA kernels (gpu/kernels/*.cu), for tests without a GPU.

emulator.py: the fake CuPy and the build; cases.py: the case matrix; run.py: runs suites in a
process of their own (`python tests/gpu/cuda_emu/run.py --help`); mutate.py: plants known bugs
and checks that the cases notice. tests/gpu/test_gpu_emulator.py drives all of it from pytest.
"""
