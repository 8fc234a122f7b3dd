"""Terminal output of the CLI's tables: fit the terminal (COLUMNS, 80 when not a terminal), wrap
headers and footnotes instead of cutting them; `--wide` widens the console to the whole table.
Into a pipe or a file the rules are ASCII, so that a line's length is the same in columns and bytes."""
from __future__ import annotations

# table()'s box (rich's MINIMAL_HEAVY_HEAD) in ASCII: the header rule "=", column rules "|", crossings
# "+". Its box-drawing characters are 3 bytes each in UTF-8, so a 76-column rule was 228 bytes in a log
# (what `awk length` in the C locale, `cut -c` and most log viewers count)
ASCII_BOX = ("  | \n"
             "  | \n"
             " =+ \n"
             "  | \n"
             " -+ \n"
             " -+ \n"
             "  | \n"
             "  | \n")


def table(title: str, columns: list[str], left: tuple[str, ...] = ()):
    """A rich Table without outer borders or edge padding (every character counts at 80 columns); a
    header may hold newlines ("busbw\nGB/s") so that it is no wider than its numbers. Where the
    terminal is too narrow, text columns (`left`) fold; number columns never do (a number cut over
    two rows reads as two numbers)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.MINIMAL_HEAVY_HEAD, show_edge=False, pad_edge=False)
    for col in columns:
        number = col not in left
        t.add_column(col, justify="right" if number else "left", overflow="fold", no_wrap=number,
                     min_width=max(len(w) for w in col.split("\n")) if number else None)
    return t


def console(t=None, wide: bool = False, file=None):
    """A Console of the terminal's width (rich reads COLUMNS; 80 when stdout is not a terminal) on
    `file` (stdout); at least as wide as the table `t` needs with every number whole (on a terminal
    too narrow for that, rich would crop them), with `wide` on one line per row. Not on a terminal,
    `t` is drawn with ASCII_BOX."""
    from rich.box import Box
    from rich.console import Console

    con = Console(highlight=False, file=file)
    if t is not None:
        if not con.is_terminal:
            t.box = Box(ASCII_BOX, ascii=True)
        need = Console(width=10_000).measure(t).maximum if wide else _narrowest(t)
        if need > con.width:
            con = Console(width=need, highlight=False, file=file)
    return con


TEXT_MIN = 4  # the fewest characters a folding (text) column keeps per line


def _narrowest(t) -> int:
    """The narrowest width at which table `t` (made by `table`) shows every number whole: number
    columns at their widest cell, text columns folded to TEXT_MIN, " │ " between columns."""
    widths = []
    for col in t.columns:
        cells = [str(c) for c in col.cells] + str(col.header).split("\n")
        widest = max((len(line) for c in cells for line in c.split("\n")), default=0)
        widths.append(widest if col.no_wrap else min(widest, TEXT_MIN))
    return sum(widths) + 3 * (len(widths) - 1)


def note(con, text: str) -> None:
    """A footnote, wrapped at the console's width between words, no line ending in a space (no
    markup: brackets such as nic_in[7,3] stay)."""
    import textwrap

    lines = textwrap.fill(text, con.width, break_on_hyphens=False, break_long_words=False)
    con.print(lines, markup=False, highlight=False, soft_wrap=True)


class quiet_children:
    """Spawned worker processes (torch.multiprocessing spawn) start with PYTHONWARNINGS=ignore: Megatron's
    import-time Apex / Transformer Engine and deprecation warnings are noise, as `demo` already treats them.
    A PYTHONWARNINGS the user set is kept."""

    def __enter__(self):
        import os

        self.before = os.environ.get("PYTHONWARNINGS")
        if self.before is None:
            os.environ["PYTHONWARNINGS"] = "ignore"
        return self

    def __exit__(self, *exc):
        import os

        if self.before is None:
            os.environ.pop("PYTHONWARNINGS", None)
        return False


def wrapped(text: str) -> str:
    """A progress or summary line for stderr at 80 columns, continuation lines indented (paths and
    names are not broken)."""
    import textwrap

    return textwrap.fill(text, 80, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
