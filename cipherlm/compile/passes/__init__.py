"""Graph passes, one per file (SecretFlow-SPU's compiler layout): each `run(graph, ...)`
returns a new graph (and, for passes that rewrite weights, new parameters); the input
graph is left as it was."""

from . import fold_norms, group_linears

__all__ = ["fold_norms", "group_linears"]
