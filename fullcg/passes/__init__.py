"""Graph passes the compile backend runs before splitting and compiling a graph."""

from fullcg.passes.attributes import AttributesPass, BreakablePass, attention_nodes
from fullcg.passes.manager import PassManager
from fullcg.passes.split import Piece, SplitGraph, split_graph

__all__ = ["AttributesPass", "BreakablePass", "PassManager", "Piece", "SplitGraph", "attention_nodes", "split_graph"]
