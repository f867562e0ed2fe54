"""The devices `plan.device` names: what a datasheet says of each accelerator and the node it ships in (pure data).

Every figure is the vendor's, dense (no 2:4 sparsity), with the datasheet it comes from beside it in `sources`.
What the planner makes of them (the share of a peak a GEMM or a link reaches) is planner/compute.py's and
planner/topology.py's, stated there: this file holds only what was published.

  bf16_tflops, fp8_tflops  peak dense tensor-core TFLOP/s (10^12), per device (fp8: 0 where the device has none)
  memory_gb, memory_tbs    HBM capacity (GB, 10^9 bytes) and bandwidth (TB/s)
  link_gbs                 NVLink / xGMI bandwidth per device, GB/s, both directions together (as datasheets count)
  network_gbs              scale-out network per node, GB/s (the node's NICs together, one direction)
  devices_per_node         devices in one node of the reference system

`plan.device=local` is not here: it keeps the planner's calibrated CPU behaviour (plan.tflops, plan.*_gbs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOCAL = "local"


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_tflops: float
    fp8_tflops: float
    memory_gb: float
    memory_tbs: float
    link_gbs: float
    network_gbs: float
    devices_per_node: int
    sources: dict[str, str] = field(default_factory=dict)  # figure -> the datasheet (name and URL) it comes from

    def peak_tflops(self, fp8: bool = False) -> float:
        """The peak a GEMM is held against: fp8's where asked and the device has one, else bf16's."""
        return self.fp8_tflops if fp8 and self.fp8_tflops else self.bf16_tflops


_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_DGX_A100 = ("NVIDIA DGX A100 datasheet (8x ConnectX-6 200 Gb/s HDR per node), "
             "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf")
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5), https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_DGX_H100 = ("NVIDIA DGX H100 datasheet (8x ConnectX-7 400 Gb/s per node), "
             "https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx")
_H800 = ("NVIDIA H800 SXM5 product brief (H100 compute, NVLink 400 GB/s); nodes of 8 with 8x 400 Gb/s InfiniBand "
         "as DeepSeek-V3's report describes them (arXiv 2412.19437, section 3.1)")
_H100_GT = ("pytorch/torchtitan docs/performance.md (Grand Teton hosts: 8 H100 96 GB HBM2e, 2.4 TB/s, 500 W, NVLink, "
            "400 Gb/s per GPU) with the NVIDIA H100 NVL datasheet's dense peaks, "
            "https://www.nvidia.com/en-us/data-center/h100/")
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM), https://resources.nvidia.com/en-us-data-center-overview-mc/en-us-data-center-overview/hpc-datasheet-sc23-h200"
_B200 = ("NVIDIA DGX B200 datasheet (8x B200: 72 PFLOPS FP8 and 36 PFLOPS FP16/BF16 training with sparsity, 1,440 GB "
         "HBM3e at 64 TB/s, NVLink 5 at 1.8 TB/s per GPU, 8x ConnectX-7 400 Gb/s), "
         "https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet")
_MI300X = ("AMD Instinct MI300X accelerator datasheet (1,307.4 TFLOPS BF16 and 2,614.9 FP8 dense, 192 GB HBM3 at "
           "5.3 TB/s, 7 Infinity Fabric links, 896 GB/s peak aggregate), "
           "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf")
_MI300X_NODE = "AMD Instinct MI300X platform (8 OAM per node; 8x 400 Gb/s NICs as its reference designs pair them)"


def _sourced(compute: str, node: str) -> dict[str, str]:
    return {"bf16_tflops": compute, "fp8_tflops": compute, "memory_gb": compute, "memory_tbs": compute,
            "link_gbs": compute, "network_gbs": node, "devices_per_node": node}


CATALOG: dict[str, DeviceSpec] = {d.name: d for d in (
    # A100 SXM4: 312 TFLOPS BF16 dense (624 sparse), no FP8; 40 GB HBM2 at 1,555 GB/s; NVLink 3, 600 GB/s
    DeviceSpec("a100-40gb", 312.0, 0.0, 40.0, 1.555, 600.0, 200.0, 8, _sourced(_A100, _DGX_A100)),
    # A100 80GB SXM4: HBM2e at 2,039 GB/s (the Selene nodes of Megatron-LM's arXiv 2104.04473)
    DeviceSpec("a100-80gb", 312.0, 0.0, 80.0, 2.039, 600.0, 200.0, 8, _sourced(_A100, _DGX_A100)),
    # H100 SXM5: 989 TFLOPS BF16 dense (1,979 sparse), 1,979 FP8 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 4, 900 GB/s
    DeviceSpec("h100-sxm", 989.0, 1979.0, 80.0, 3.35, 900.0, 400.0, 8, _sourced(_H100, _DGX_H100)),
    DeviceSpec("h800", 989.0, 1979.0, 80.0, 3.35, 400.0, 400.0, 8, _sourced(_H800, _H800)),
    # the H100s of torchtitan's published runs (Meta's Grand Teton): 96 GB HBM2e at 2.4 TB/s, 500 W, a peak "between
    # SXM and NVL" (their note): the H100 NVL's 835 dense BF16 / 1,671 FP8 taken, the lower end
    DeviceSpec("h100-gt", 835.0, 1671.0, 96.0, 2.4, 900.0, 400.0, 8, _sourced(_H100_GT, _H100_GT)),
    # H200 SXM: H100's compute, 141 GB HBM3e at 4.8 TB/s
    DeviceSpec("h200", 989.0, 1979.0, 141.0, 4.8, 900.0, 400.0, 8, _sourced(_H200, _DGX_H100)),
    # B200 (DGX B200 per GPU): 2,250 BF16 and 4,500 FP8 dense, 180 GB at 8 TB/s, NVLink 5 1,800 GB/s
    DeviceSpec("b200", 2250.0, 4500.0, 180.0, 8.0, 1800.0, 400.0, 8, _sourced(_B200, _B200)),
    DeviceSpec("mi300x", 1307.4, 2614.9, 192.0, 5.3, 896.0, 400.0, 8, _sourced(_MI300X, _MI300X_NODE)),
)}


def device_spec(name: str) -> DeviceSpec:
    """The catalog's entry for `name`; a one-line error listing the catalog for any other name."""
    if name not in CATALOG:
        raise ValueError(f"plan.device={name!r} is not in the catalog: choose one of {LOCAL}, {', '.join(CATALOG)}")
    return CATALOG[name]
