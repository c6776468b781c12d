"""Graph passes the compile backend runs before splitting and compiling a graph."""

from fullcg.passes.attributes import AttributesPass, attention_nodes
from fullcg.passes.manager import PassManager
from fullcg.passes.split import Piece, SplitGraph, SplitPointsPass, split_graph

__all__ = ["AttributesPass", "PassManager", "Piece", "SplitGraph", "SplitPointsPass", "attention_nodes", "split_graph"]
