"""``ModuleTree``: the model's module hierarchy with call counts and output shapes.

Labels fit the tree's width (about 28 cells at 80 columns), the name first: a label too long
for its line leaves out the shape (the details pane shows it; the line ends in ``…``), and only
a name that does not fit on its own is cut, in the middle (``post_atte…layernorm``) — a shape
is never shown cut, where ``2×64`` would read as a shape.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from hooks.text import printable
from tui.widgets import fmt

#: Fewest cells a cut name keeps (the call count and ``…`` are left out below that).
MIN_NAME = 6


#: Module types that hold modules and have no forward of their own: never called, they show
#: their number of children (``layers [4]``).
CONTAINERS = frozenset({"ModuleList", "ModuleDict", "ParameterList", "ParameterDict"})


def fit_label(leaf: str, calls: str, shape: str, width: int | None, *, called: bool = True,
              n_children: int = 0, idle: str = "not called") -> Text:
    """A node's label, ``leaf ×calls shape``, in at most ``width`` cells (None: no limit).

    Args:
        leaf: the module's own name.
        calls: ``" ×3"`` when called more than once, else ``""``.
        shape: the first call's output shape (``2×64×256``; of :func:`main_output`), or
            ``""``.
        width: cells the label may take.
        called: False for a module never called (dim, ``[n]`` children or ``idle``).
        n_children: children of a container (:data:`CONTAINERS`), which is never called; 0
            for any other module.
        idle: what a module that is not a container says when it was not called: ``not
            called``, or ``no tokens`` for an MoE expert no token was routed to.
    """
    if not called:
        tail = f" [{n_children}]" if n_children else f" {idle}"
        if width is not None and cell_len(leaf + tail) > width:
            if width - cell_len(tail) >= MIN_NAME:
                leaf = fmt.middle(leaf, width - cell_len(tail))
            else:
                leaf, tail = fmt.middle(leaf, max(width, 1)), ""
        text = Text(leaf, style="dim")
        text.append(tail, style="dim")
        return text
    shape_part = f" {shape}" if shape else ""
    if width is not None and cell_len(leaf + calls + shape_part) > width:
        shape_part = " …" if shape else ""  # the whole shape, or none of it
        if cell_len(leaf + calls + shape_part) > width:
            room = width - cell_len(calls + shape_part)
            if room < MIN_NAME:
                calls, shape_part, room = "", "", width
            leaf = fmt.middle(leaf, max(room, 1))
    text = Text(leaf, style="bold")
    if calls:
        text.append(calls, style="cyan")
    if shape_part:
        text.append(shape_part, style="dim" if shape_part == " …" else "")
    return text


def main_output(outputs):
    """The output a call's one shape stands for: the first one with a dimension (HF's
    ``out.logits`` after the 0-dim ``out.loss`` and ``out.aux_loss``), else the first; ``None``
    for a call without tensor outputs."""
    return next((t for t in outputs if len(t.shape) > 0), outputs[0] if outputs else None)


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
        #: label parts of each node: (leaf, calls text, shape text, called, children of a
        #: container, what it says when not called)
        self.parts: dict[str, tuple[str, str, str, bool, int, str]] = {}
        self.labels: dict[str, Text] = {}
        self.current: str | None = None
        self._fit_width: int | None = None
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
                main = main_output(rec.outputs)
                first_out[rec.module] = main.shape if main is not None else None

        types = {info.name: info.module_type for info in trace.modules}

        def parts(leaf: str, name: str) -> tuple[str, str, str, bool, int, str]:
            n = calls.get(name, 0)
            shape = first_out.get(name)
            container = types.get(name) in CONTAINERS
            expert = _parent_name(name).rsplit(".", 1)[-1] == "experts" and bool(name)
            return (leaf, f" ×{n}" if n > 1 else "", fmt.dims(shape) if shape is not None
                    else "", n > 0, children.get(name, 0) if container else 0,
                    "no tokens" if expert else "not called")

        self.parts[""] = parts(printable(root_type or "model"), "")
        self.labels[""] = self._label("")
        self.root.set_label(self.labels[""])
        self.root.expand()
        for info in trace.modules:
            if not info.name:
                continue
            parent = self.nodes_by_name.get(_parent_name(info.name), self.root)
            self.parts[info.name] = parts(printable(info.name.rsplit(".", 1)[-1]), info.name)
            self.labels[info.name] = self._label(info.name)
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

    def render_lines(self, crop):
        """Textual's, with the widget's base style looked up once per frame, not once per line
        (:attr:`rich_style` walks the ancestors' backgrounds: ~1/3 of a tree line's cost)."""
        self._frame_style = self.rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._frame_style = None

    def render_line(self, y: int):
        style = getattr(self, "_frame_style", None)
        render = getattr(self, "_render_line", None)  # Textual's (8.x); else its own path
        if style is None or render is None:
            return super().render_line(y)
        scroll_x, scroll_y = self.scroll_offset
        return render(y + scroll_y, scroll_x, scroll_x + self.size.width, style)

    def _label(self, name: str, width: int | None = None) -> Text:
        leaf, calls, shape, called, n_children, idle = self.parts[name]
        return fit_label(leaf, calls, shape, width, called=called, n_children=n_children,
                         idle=idle)

    def _room(self, name: str) -> int | None:
        """Cells left for ``name``'s label on its line: the tree's width less the guides (two
        cells per level), the expand icon and the current-module marker."""
        if self._fit_width is None:
            return None
        node = self.nodes_by_name[name]
        depth, parent = 0, node.parent
        while parent is not None:
            depth, parent = depth + 1, parent.parent
        used = 2 * depth + (2 if node.allow_expand else 0) + (2 if name == self.current else 0)
        return max(self._fit_width - used, 1)

    def _relabel(self, name: str) -> None:
        self.labels[name] = self._label(name, self._room(name))
        label = self.labels[name]
        if name == self.current:
            label = Text("● ", style="bold yellow") + label
        self.nodes_by_name[name].set_label(label)

    def on_resize(self) -> None:
        """Fit every label to the new width."""
        width = self.scrollable_content_region.width
        if width <= 0 or width == self._fit_width:
            return
        self._fit_width = width
        for name in self.nodes_by_name:
            self._relabel(name)

    def show_module(self, name: str) -> None:
        """Mark ``name``'s node as the current module (``●``, readable without colour), expand
        its ancestors and put the cursor on it (no selection event)."""
        node = self.nodes_by_name.get(name)
        if node is None:
            return
        if self.current != name:
            previous, self.current = self.current, name
            if previous in self.nodes_by_name:
                self._relabel(previous)
            self._relabel(name)
        parent = node.parent
        while parent is not None:
            if not parent.is_expanded:
                parent.expand()
            parent = parent.parent
        _ = self.last_line  # rebuild the line cache so the node's line is known
        self.move_cursor(node)
        if node.line >= 0:  # keep the current module mid-height, with context on both sides
            self.scroll_to(y=max(0, node.line - self.size.height // 2), animate=False)
