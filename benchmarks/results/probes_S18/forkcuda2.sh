set -x
python s18probe/forkcuda.py
PYTORCH_NVML_BASED_CUDA_CHECK=1 python s18probe/forkcuda.py
