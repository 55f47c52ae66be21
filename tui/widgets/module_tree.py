"""``ModuleTree``: the model's module hierarchy with call counts and output shapes."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from tui.widgets import fmt


def _parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


class ModuleTree(Tree[str]):
    """Every module of a trace (``trace.modules``), one node each, labelled
    ``leaf ×calls 2×64×256`` (the count only when called more than once, the first call's output
    shape); a container that is never called itself (a ``ModuleList`` of layers, an
    ``experts`` list) reads ``layers [4]`` (its children), an uncalled leaf ``… not called``.
    Each node's ``data`` is the qualified module name.

    The children of MoE ``experts`` containers start collapsed (a layer has E of them);
    :meth:`show_module` expands whatever is needed to reveal a node. Selecting a node (Enter)
    posts Textual's ``Tree.NodeSelected``; the step view jumps to that module's first call.
    """

    def __init__(self, trace, **kwargs) -> None:
        root_type = trace.modules[0].module_type if trace.modules else trace.model_type
        super().__init__(root_type or "model", data="", **kwargs)
        self.auto_expand = False
        self.guide_depth = 2
        self.nodes_by_name: dict[str, TreeNode[str]] = {"": self.root}
        self.labels: dict[str, Text] = {}
        self.current: str | None = None
        first_out: dict[str, list[int] | None] = {}
        calls: dict[str, int] = {}
        children: dict[str, int] = {}
        for info in trace.modules:
            if info.name:
                parent = _parent_name(info.name)
                children[parent] = children.get(parent, 0) + 1
        for rec in trace.forward:
            calls[rec.module] = calls.get(rec.module, 0) + 1
            if rec.module not in first_out:
                first_out[rec.module] = rec.outputs[0].shape if rec.outputs else None
        self.labels[""] = self._label(root_type or "model", calls.get("", 0), first_out.get(""),
                                      children.get("", 0))
        self.root.set_label(self.labels[""])
        self.root.expand()
        for info in trace.modules:
            if not info.name:
                continue
            parent = self.nodes_by_name.get(_parent_name(info.name), self.root)
            leaf = info.name.rsplit(".", 1)[-1]
            self.labels[info.name] = self._label(leaf, calls.get(info.name, 0),
                                                 first_out.get(info.name),
                                                 children.get(info.name, 0))
            node = parent.add(
                self.labels[info.name],
                data=info.name,
                expand=not (parent.data or "").endswith("experts"),
                allow_expand=True,
            )
            self.nodes_by_name[info.name] = node
        for node in self.nodes_by_name.values():
            if not node.children:
                node.allow_expand = False

    @staticmethod
    def _label(leaf: str, n_calls: int, out_shape: list[int] | None, n_children: int = 0) -> Text:
        if not n_calls:
            text = Text(leaf, style="dim")
            text.append(f" [{n_children}]" if n_children else " not called", style="dim")
            return text
        text = Text(leaf, style="bold")
        if n_calls > 1:
            text.append(f" ×{n_calls}", style="cyan")
        if out_shape is not None:
            text.append(" " + fmt.dims(out_shape))
        return text

    def show_module(self, name: str) -> None:
        """Mark ``name``'s node as the current module (``●``, readable without colour), expand
        its ancestors and put the cursor on it (no selection event)."""
        node = self.nodes_by_name.get(name)
        if node is None:
            return
        if self.current != name:
            if self.current in self.nodes_by_name:
                self.nodes_by_name[self.current].set_label(self.labels[self.current])
            node.set_label(Text("● ", style="bold yellow") + self.labels[name])
            self.current = name
        parent = node.parent
        while parent is not None:
            if not parent.is_expanded:
                parent.expand()
            parent = parent.parent
        _ = self.last_line  # rebuild the line cache so the node's line is known
        self.move_cursor(node)
        if node.line >= 0:  # keep the current module mid-height, with context on both sides
            self.scroll_to(y=max(0, node.line - self.size.height // 2), animate=False)
