# Sourced by the scripts that run legendctl's GPU engine on the GPU machine: puts NVRTC
# (libnvrtc.so.13, loaded at run time) on LD_LIBRARY_PATH, the toolkit's copy first, else the
# one PyTorch's wheels ship.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null); do
    [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
done
# NVLink multicast off on every machine these scripts run on: it can take a shared host's GPUs
# out of service (the binaries set it too, unless it is set).
export NCCL_NVLS_ENABLE=0
