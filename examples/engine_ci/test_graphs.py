"""Graph tests as an engine writes them: capture, reload, replay, check the output looks right.

Both pass without the plugin. Under `pytest --repro-watch` the second fails, naming the
captured tensor the reload freed (layer.kernel.workspace) and the test phases that captured
and replayed the graph: the output still looked right, the graph read freed memory.
"""

import torch

from engine_layer import Layer, new_weights

HIDDEN, BATCH = 256, 8


def capture(layer: Layer, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # warm up outside the capture, as engines do
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    return graph, out


def test_graph_after_reload_matches_eager(cuda):
    layer = Layer(HIDDEN, cuda, reuse_kernel=True)
    x = torch.randn(BATCH, HIDDEN, device=cuda)
    graph, out = capture(layer, x)
    layer.reload(new_weights(layer, seed=1))
    graph.replay()
    torch.testing.assert_close(out, layer(x))


def test_reload_rebuilds_the_kernel_under_a_graph(cuda):
    layer = Layer(HIDDEN, cuda, reuse_kernel=False)
    x = torch.randn(BATCH, HIDDEN, device=cuda)
    graph, out = capture(layer, x)
    graph.replay()
    layer.reload(new_weights(layer, seed=1))  # a new Kernel: the old workspace is freed
    graph.replay()
    assert torch.isfinite(out).all()  # "looks right": the check engines' tests make
