"""The model graph (issue 13): typed operator nodes, one builder per model family from
one architecture table, passes as files. Imports only numpy and lower layers.

    from cipherlm.compile import build_graph, bind
    g = build_graph(config)             # cipherlm.compile.ir.Graph
    params = bind(g, hf_weights)        # graph tensor name -> array
    g = passes.group_linears.run(g)     # projection groups
    g, params = passes.fold_norms.run(g, params)
"""

from .arch import FAMILIES, Arch, arch_from_config
from .builders import build_graph
from .ir import OPS, Graph, Node, Tensor
from .weights import bind, linear_weights

__all__ = ["FAMILIES", "Arch", "arch_from_config", "build_graph", "OPS", "Graph", "Node", "Tensor", "bind",
           "linear_weights"]
