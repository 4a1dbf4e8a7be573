"""A layer shaped like an engine's quantized layer: a registered weight plus a kernel object
whose device tensors (a workspace, derived scales) the forward reads and a CUDA graph captures.

`process_weights_after_loading` runs after the first load and after every reload. With
reuse_kernel=False it builds a NEW kernel each time (the bug family of vLLM #50074 / #41670):
a graph captured before the reload keeps the old kernel's addresses. With reuse_kernel=True
the kernel is built once and refreshed in place (the fix).
"""

import torch
from torch import nn


class Kernel:
    """Kernel-owned state: not a parameter, so a layerwise reload does not protect it."""

    def __init__(self, weight: torch.Tensor):
        self.workspace = torch.empty_like(weight)  # [out, in] prepared weight
        self.scale = torch.empty(weight.shape[0], device=weight.device)  # [out] per-row scale

    def refresh(self, weight: torch.Tensor) -> None:
        self.scale.copy_(weight.abs().amax(dim=1).clamp(min=1e-6))
        self.workspace.copy_(weight / self.scale[:, None])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.workspace.t()) * self.scale


class Layer(nn.Module):
    def __init__(self, hidden: int, device: torch.device, reuse_kernel: bool, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(hidden, hidden, generator=gen).to(device), requires_grad=False)
        self.reuse_kernel = reuse_kernel
        self.kernel: Kernel | None = None
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        if self.kernel is None or not self.reuse_kernel:
            self.kernel = Kernel(self.weight)
        self.kernel.refresh(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(x)

    @torch.no_grad()
    def reload(self, weight: torch.Tensor) -> None:
        """Weight loaders copy into the parameter in place; then PWAL runs again."""
        self.weight.copy_(weight)
        self.process_weights_after_loading()


def new_weights(layer: Layer, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layer.weight.shape, generator=gen).to(layer.weight.device)
