"""verify(graph): structural checks run after every pass in tests."""

from __future__ import annotations

from .graph import INPUT_OPS, Graph, Op


class GraphVerificationError(AssertionError):
    pass


def verify(graph: Graph) -> Graph:
    """Check value ids, single definition, definition before use, and order of firing."""
    problems: list[str] = []
    defined: set[int] = set()
    last_fire = -1
    n_values = len(graph.values)
    for index, node in enumerate(graph.nodes):
        for vid in node.inputs:
            if not 0 <= vid < n_values:
                problems.append(f"node {index} ({node.name}) reads value {vid}, out of range")
            elif vid not in defined:
                problems.append(f"node {index} ({node.name}) reads {vid} before it is defined")
        for vid in dict.fromkeys((*node.outputs, *node.writes)):  # an in-place op returns what it writes
            if vid is None:
                continue
            if not 0 <= vid < n_values:
                problems.append(f"node {index} ({node.name}) defines value {vid}, out of range")
            elif vid in defined:
                problems.append(f"node {index} ({node.name}) redefines value {vid}")
            defined.add(vid)
        if node.op in INPUT_OPS:
            if node.inputs or len(node.outputs) != 1:
                problems.append(f"input node {index} must have no inputs and one output")
        else:
            if not node.positions:
                problems.append(f"node {index} ({node.name}) covers no record position")
            elif node.fire_at < last_fire:
                problems.append(f"node {index} ({node.name}) fires at {node.fire_at}, before its predecessor")
            else:
                last_fire = node.fire_at
        if node.op is Op.FUSED and not node.members:
            problems.append(f"fused node {index} has no members")
    for vid in graph.outputs:
        if vid not in defined:
            problems.append(f"graph output {vid} is never defined")
    for index, value in enumerate(graph.values):
        if value.id != index:
            problems.append(f"value at index {index} has id {value.id}")
        if not 0 <= value.handle < graph.num_handles:
            problems.append(f"value {value.id} refers to handle {value.handle}, out of range")
    if problems:
        raise GraphVerificationError("graph verification failed:\n  " + "\n  ".join(problems) + "\n" + str(graph))
    return graph
