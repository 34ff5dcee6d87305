# megatron-het images for GPU clusters. Pick the vendor with a build argument:
#   docker build --build-arg VENDOR=nvidia -t megatron-het:nvidia .
#   docker build --build-arg VENDOR=amd    -t megatron-het:amd .
# The NVIDIA base (NGC PyTorch) ships torch, transformer-engine and apex; the AMD base (ROCm
# PyTorch) ships a HIP torch. Their torch is kept (scripts/bootstrap_env.sh never replaces an
# importable torch), so the install steps are the same commands the README uses.
ARG VENDOR=nvidia
ARG NVIDIA_BASE=nvcr.io/nvidia/pytorch:25.09-py3
ARG AMD_BASE=rocm/pytorch:rocm6.4_ubuntu24.04_py3.12_pytorch_release_2.6.0

FROM ${NVIDIA_BASE} AS base-nvidia
ENV NCCL_DEBUG=WARN

FROM ${AMD_BASE} AS base-amd
ENV NCCL_DEBUG=WARN \
    HSA_FORCE_FINE_GRAIN_PCIE=1

# hadolint ignore=DL3006
FROM base-${VENDOR} AS final
WORKDIR /opt/megatron-het
# The repository without what .dockerignore leaves out (a local .venv, build/, compiled *.so, caches,
# runs/, data/, .git): the image builds its own environment below.
COPY . .
# Same steps as `make env`: keep the image's torch, add megatron-core and our package (compiling
# csrc/ against the image's CUDA or ROCm toolkit).
RUN PYTHON=python3 VENV=/opt/venv bash scripts/bootstrap_env.sh
ENV PATH=/opt/venv/bin:$PATH
CMD ["python", "pretrain_scripts/demo.py"]
