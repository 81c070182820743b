"""The one meter (runtime/meter.py): per op class and per graph node, from the channel's
exact counters; one vocabulary (compile.ir.OP_CLASSES) for every mode."""

import numpy as np
import pytest

from cipherlm.compile.ir import OP_CLASS, OP_CLASSES
from cipherlm.mpc.runner import run_inprocess
from cipherlm.runtime import twopc
from cipherlm.runtime.meter import Meter
from cipherlm.runtime.twopc_executors import make_twopc_executor
from test_twopc import llama_model


def test_every_graph_op_has_a_class_of_the_vocabulary():
    from cipherlm.compile.ir import OPS

    assert set(OP_CLASS) == set(OPS)
    assert set(OP_CLASS.values()) <= set(OP_CLASSES)
    with pytest.raises(ValueError, match="unknown operator class"):
        with Meter()("attention"):  # an old name of the plain profiler: gone
            pass


def test_meter_by_node_adds_up_to_the_channel():
    """A 1-layer 2pc forward: every byte either party sent is in exactly one graph node's
    row (the setup included, which the first node that needs it pays), and the per-class
    totals are the same bytes."""
    config, w = llama_model(num_hidden_layers=1)
    sw = twopc.server_weights(config, w)
    plan = twopc.public_plan(config, sw, embedding="onehot-linear")

    def party(ctx):
        meter = Meter(ctx.chan)
        ex = make_twopc_executor(ctx, config, sw if ctx.party == 1 else None, plan, meter=meter)
        ex.forward(np.array([4, 8, 15]) if ctx.party == 0 else None, 3)
        sent = sum(v["bytes_sent"] for v in ctx.chan.stats().values())
        return meter.by_node(), meter.summary(), sent, [n.name for n in ex.graph.nodes]

    (nodes, classes, sent, names), (nodes1, _, sent1, _) = run_inprocess(party, timeout=300)
    assert set(nodes) <= set(names)
    assert sum(r["bytes_sent"] for r in nodes.values()) == sent
    assert sum(r["bytes_sent"] for r in nodes1.values()) == sent1
    assert sum(c["bytes_sent"] for c in classes.values()) == sent
    assert set(classes) <= set(OP_CLASSES)
    assert nodes["L0.softmax"]["op_class"] == "softmax" and nodes["L0.softmax"]["bytes"] > 0
    assert nodes["L0.q"]["op_class"] == "linear"  # the q/k/v group, metered at its first node
    assert "L0.k" not in nodes
    assert nodes["L0.q_rope"]["bytes"] == 0  # public linear map: free
