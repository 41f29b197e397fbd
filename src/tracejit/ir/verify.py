"""verify(graph): checks run after every pass when TRACEJIT_VERIFY=1 (the test suite sets it).

Structure: value ids in range, each defined once and before use, nodes in firing order, the
outputs defined, views in the storage of a value their node reads. Metadata: a CALL node's
recorded input metas are those of the values it reads, and its results have the shapes and dtypes
the op gives for its inputs (meta_check.py, which says what it cannot check). Fused groups:
members are CALL nodes whose inputs come from the group's inputs or earlier members, whose
outputs and writes the group's are, and which walk the group's iteration space.
"""

from __future__ import annotations

from ..record.calls import aliases_its_input
from .graph import INPUT_OPS, Graph, Node, Op
from .meta_check import meta_mismatches


class GraphVerificationError(AssertionError):
    pass


def verify(graph: Graph, after: str | None = None, *, metadata: bool = True) -> Graph:
    """Raise GraphVerificationError listing every problem, naming the pass `after` which the graph
    broke, with the graph printed; return the graph when it is sound. `metadata=False` checks the
    structure only."""
    problems: list[str] = []
    in_range = _all_in_range(graph)
    defined: set[int] = set()
    last_fire = -1
    n_values = len(graph.values)
    for index, node in enumerate(graph.nodes):
        where = f"node {index} ({node.name})"
        for vid in node.inputs:
            if not 0 <= vid < n_values:
                problems.append(f"{where} reads value {vid}, out of range")
            elif vid not in defined:
                problems.append(f"{where} reads {vid} before it is defined")
        for vid in dict.fromkeys((*node.outputs, *node.writes)):  # an in-place op returns what it writes
            if vid is None:
                continue
            if not 0 <= vid < n_values:
                problems.append(f"{where} defines value {vid}, out of range")
            elif vid in defined:
                problems.append(f"{where} redefines value {vid}")
            defined.add(vid)
        if node.op in INPUT_OPS:
            if node.inputs or len(node.outputs) != 1:
                problems.append(f"input node {index} must have no inputs and one output")
            continue
        if not node.positions:
            problems.append(f"{where} covers no record position")
        elif node.fire_at < last_fire:
            problems.append(f"{where} fires at {node.fire_at}, before its predecessor")
        else:
            last_fire = node.fire_at
        if in_range:
            problems += [f"{where} {p}" for p in _node_problems(graph, node, metadata)]
    for vid in graph.outputs:
        if vid not in defined:
            problems.append(f"graph output {vid} is never defined")
    for index, value in enumerate(graph.values):
        if value.id != index:
            problems.append(f"value at index {index} has id {value.id}")
        if not 0 <= value.handle < graph.num_handles:
            problems.append(f"value {value.id} refers to handle {value.handle}, out of range")
    if problems:
        stage = f" after {after}" if after else ""
        raise GraphVerificationError(f"graph verification failed{stage}:\n  " + "\n  ".join(problems) + "\n"
                                     + str(graph))
    return graph


def _all_in_range(graph: Graph) -> bool:
    """Metadata checks need every value id to exist (the structural checks report those that do not)."""
    ids = [v for node in graph.nodes for m in (node, *node.members) for v in (*m.inputs, *m.outputs, *m.writes)]
    return all(v is None or 0 <= v < len(graph.values) for v in ids)


def _node_problems(graph: Graph, node: Node, metadata: bool) -> list[str]:
    if node.op is Op.FUSED:
        return _group_problems(graph, node, metadata)
    return _call_problems(graph, node, metadata)


def _call_problems(graph: Graph, node: Node, metadata: bool) -> list[str]:
    problems = _view_root_problems(graph, node)
    if not metadata:
        return problems
    if node.input_metas:  # graphs built by hand may leave them out
        reads = [graph.values[v].meta for v in node.inputs]
        if len(node.input_metas) != len(reads):
            problems.append(f"records {len(node.input_metas)} input metas for {len(reads)} inputs")
        for i, (recorded, meta) in enumerate(zip(node.input_metas, reads)):
            if (recorded.shape, recorded.dtype) != (meta.shape, meta.dtype):
                problems.append(f"input {i} was recorded as {recorded} but reads a {meta}")
    return problems + meta_mismatches(graph, node)


def _view_root_problems(graph: Graph, node: Node) -> list[str]:
    """A view lives in the storage of a value its node reads: plan_memory keeps a view's root
    alive while the view is read, so a view rooted elsewhere lets its real storage be reused under
    it (a pass that substitutes a value must move the views of it too)."""
    if not aliases_its_input(node.target):
        return []
    read = {graph.values[v].root for v in node.inputs}
    return [f"makes view {vid} in storage t{graph.values[vid].root}, which it does not read (it reads "
            f"{', '.join(f't{r}' for r in sorted(read))})" for vid in node.outputs
            if vid is not None and graph.values[vid].root != graph.values[vid].handle
            and graph.values[vid].root not in read]


def _group_problems(graph: Graph, node: Node, metadata: bool) -> list[str]:
    if not node.members:
        return ["is a fused group without members"]
    problems = []
    available = set(node.inputs)
    produced: set[int] = set()
    for number, member in enumerate(node.members):
        if member.op is not Op.CALL:
            problems.append(f"has a {member.op.value} node as member {number}")
            continue
        missing = [v for v in member.inputs if v not in available]
        if missing:
            problems.append(f"member {number} ({member.name}) reads {missing}: neither a group input nor an "
                            f"earlier member's value")
        made = {v for v in (*member.outputs, *member.writes) if v is not None}
        available |= made
        produced |= made
        problems += [f"member {number} {p}" for p in _call_problems(graph, member, metadata)]
        if getattr(node.target, "kind", "elementwise") == "linear":
            problems += _chain_problems(node, number, member)
        else:
            problems += _space_problems(graph, node, number, member)
    if not set(v for v in node.outputs if v is not None) <= produced:
        problems.append("produces values no member computes")
    if node.writes != tuple(v for m in node.members for v in m.writes):
        problems.append("writes differ from its members' writes")
    if tuple(sorted(node.positions)) != tuple(sorted(p for m in node.members for p in m.positions)):
        problems.append("covers other record positions than its members")
    return problems


def _space_problems(graph: Graph, node: Node, number: int, member: Node) -> list[str]:
    """A plain group's members all compute the group's shape (one element per index)."""
    shape, lanes = getattr(node.target, "shape", None), getattr(node.target, "lanes", 1)
    if shape is None or lanes != 1:
        return []
    allowed = {tuple(shape)} | {tuple(s) for s in getattr(node.target, "rows", ())}
    return [f"member {number} ({member.name}) computes {list(graph.values[v].meta.shape)} in a group over "
            f"{list(shape)}" for v in member.outputs if v is not None and graph.values[v].meta.shape not in allowed]


def _chain_problems(node: Node, number: int, member: Node) -> list[str]:
    """A linear group's members are products, each after the first multiplying the one before."""
    if len(member.outputs) != 1:
        return [f"member {number} ({member.name}) of a linear group has {len(member.outputs)} outputs"]
    if number and node.members[number - 1].outputs[0] not in member.inputs:
        return [f"member {number} ({member.name}) of a linear group does not read the product before it"]
    return []
