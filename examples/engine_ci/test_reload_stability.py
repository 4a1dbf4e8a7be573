"""The reload-stability test an engine adds: every tensor a graph may read keeps its storage,
address and view across a reload to DIFFERENT weights. Runs on CPU (no graph needed)."""

import pytest
import torch

from repro.diagnose.stability import ReloadUnstable, expect_stable

from engine_layer import Layer, new_weights

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_reload_keeps_every_tensor_slot(repro_stable):
    layer = Layer(64, DEVICE, reuse_kernel=True)
    with repro_stable(layer, name="layer"):
        layer.reload(new_weights(layer, seed=1))


def test_a_kernel_rebuilt_on_reload_is_named_by_path():
    layer = Layer(64, DEVICE, reuse_kernel=False)
    with pytest.raises(ReloadUnstable, match=r"layer\.kernel\.workspace  freed"):
        with expect_stable(layer, name="layer"):
            layer.reload(new_weights(layer, seed=1))
