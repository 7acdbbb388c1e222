"""`hostagent history --svg FILE`: who held each GPU, drawn as a timeline.

One row per GPU; each stretch of time is coloured by its holder (the lendee in blue,
each owner in its own colour, idle in grey); each swap from the lendee to an owner is
a bracket above its row, labelled with how long the owner waited. Hand-written SVG:
no plotting library for a picture this simple. Pure: a `History` in, a string out.
"""

from __future__ import annotations

import time
from xml.sax.saxutils import escape, quoteattr

from hostagent.surfaces.history import History, span

__all__ = ["svg"]

WIDTH = 960
LEFT = 120  # room for the GPU labels
RIGHT = 24
TOP = 48  # the title
ROW = 30
GAP = 26  # room above each row for swap labels
LENDEE_COLOUR = "#4c78a8"
IDLE_COLOUR = "#dddddd"
OWNER_COLOURS = ("#f58518", "#54a24b", "#e45756", "#b279a2", "#eeca3b", "#72b7b2", "#9d755d")
SWAP_COLOUR = "#222222"
# Tick spacings to choose from, in seconds.
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
         86400)


def _attrs(**kw: object) -> str:
    return " ".join(f"{k.rstrip('_').replace('_', '-')}={quoteattr(str(v))}"
                    for k, v in kw.items())


def _colours(h: History) -> dict[str | None, str]:
    colours: dict[str | None, str] = {None: IDLE_COLOUR}
    lendees = h.lendees or ((h.lendee,) if h.lendee is not None else ())
    for lendee in lendees:  # every lendee in the lent colour: lent is lent
        colours[lendee] = LENDEE_COLOUR
    owners = sorted({s.holder for segs in h.gpus.values() for s in segs
                     if s.holder is not None and s.holder not in lendees})
    for i, owner in enumerate(owners):
        colours[owner] = OWNER_COLOURS[i % len(OWNER_COLOURS)]
    return colours


def _step(total: float, width: float) -> int:
    """A tick spacing that gives ticks at least ~90 px apart."""
    for step in STEPS:
        if total / step * 90 <= width:
            return step
    return STEPS[-1]


def svg(h: History) -> str:
    """The SVG document (a string) for history `h`."""
    rows = list(h.gpus)
    plot = WIDTH - LEFT - RIGHT
    axis_y = TOP + len(rows) * (ROW + GAP) + GAP // 2
    colours = _colours(h)
    legend_y = axis_y + 44
    height = legend_y + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" {_attrs(width=WIDTH, height=height)} '
           f'{_attrs(viewBox=f"0 0 {WIDTH} {height}", font_family="sans-serif", font_size=12)}>',
           f'<rect {_attrs(width=WIDTH, height=height, fill="white")}/>']
    if h.start is None or not rows:
        out.append(f'<text {_attrs(x=LEFT, y=TOP)}>no transitions in the journal for this '
                   'period</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"
    start, end = h.start, max(h.end, h.start + 1)
    total = end - start

    def x(at: float) -> float:
        return round(LEFT + (at - start) / total * plot, 1)

    same_day = time.localtime(start)[:3] == time.localtime(end)[:3]
    title = (f"Who held each GPU, {_clock(start, date=True)} to "
             f"{_clock(end, date=not same_day)} ({span(total)})")
    out.append(f'<text {_attrs(x=LEFT, y=24, font_size=15, font_weight="bold")}>'
               f'{escape(title)}</text>')
    step = _step(total, plot)
    ticks = list(range((int(start) // step + 1) * step, int(end) + 1, step))
    out.append(f'<g {_attrs(class_="grid", stroke="#eeeeee")}>')  # behind the rows
    out += [f'<line {_attrs(x1=x(t), x2=x(t), y1=TOP + 10, y2=axis_y)}/>' for t in ticks]
    out.append("</g>")
    for i, gpu in enumerate(rows):
        y = TOP + GAP + i * (ROW + GAP)
        out.append(f'<g {_attrs(class_="row", data_gpu=gpu)}>')
        out.append(f'<text {_attrs(x=LEFT - 10, y=y + ROW / 2 + 4, text_anchor="end")}>'
                   f'{escape(gpu)}</text>')
        for seg in h.gpus[gpu]:
            who = seg.holder or "idle"
            tip = f"{gpu}: {who} ({seg.kind}) {_clock(seg.start)}–{_clock(seg.end)}, " \
                  f"{span(seg.duration)}"
            out.append(f'<rect {_attrs(class_="segment", x=x(seg.start), y=y, height=ROW)} '
                       f'{_attrs(width=max(0.5, round(x(seg.end) - x(seg.start), 1)))} '
                       f'{_attrs(fill=colours.get(seg.holder, IDLE_COLOUR), data_holder=who)}>'
                       f'<title>{escape(tip)}</title></rect>')
        for swap in (s for s in h.swaps if s.gpu == gpu):
            x0, x1 = x(swap.start), max(x(swap.end), x(swap.start) + 2)
            top = y - 6
            tip = (f"{swap.owner} asked at {_clock(swap.start)} and held {gpu} at "
                   f"{_clock(swap.end)}: {span(swap.duration)}")
            out.append(f'<g {_attrs(class_="swap", data_owner=swap.owner)}>'
                       f'<title>{escape(tip)}</title>'
                       f'<path {_attrs(d=f"M{x0},{y} V{top} H{x1} V{y + ROW}")} '
                       f'{_attrs(fill="none", stroke=SWAP_COLOUR, stroke_width=1.5)}/>'
                       f'<text {_attrs(x=x1 + 3, y=top + 4, font_size=11)}>'
                       f'swap {escape(span(swap.duration))}</text></g>')
        out.append("</g>")
    # The time axis.
    out.append(f'<g {_attrs(class_="axis")}>')
    out.append(f'<line {_attrs(x1=LEFT, x2=LEFT + plot, y1=axis_y, y2=axis_y, stroke="#444")}/>')
    for tick in ticks:
        tx = x(tick)
        out.append(f'<line {_attrs(x1=tx, x2=tx, y1=axis_y, y2=axis_y + 5, stroke="#444")}/>')
        out.append(f'<text {_attrs(x=tx, y=axis_y + 18, text_anchor="middle", font_size=11)}>'
                   f'{_clock(tick, seconds=step < 60)}</text>')
    out.append("</g>")
    # The legend.
    out.append(f'<g {_attrs(class_="legend")}>')
    lx = LEFT
    entries = [(colours[vm], f"{vm} ({'lent' if vm in (h.lendees or (h.lendee,)) else 'gaming'})")
               for vm in colours if vm is not None]
    entries.append((IDLE_COLOUR, "idle"))
    for colour, label in entries:
        out.append(f'<rect {_attrs(x=lx, y=legend_y - 10, width=12, height=12, fill=colour)}/>')
        out.append(f'<text {_attrs(x=lx + 17, y=legend_y)}>{escape(label)}</text>')
        lx += 30 + 7 * len(label)
    out.append(f'<path {_attrs(d=f"M{lx},{legend_y + 2} V{legend_y - 10} H{lx + 12}")} '
               f'{_attrs(fill="none", stroke=SWAP_COLOUR, stroke_width=1.5)}/>')
    out.append(f'<text {_attrs(x=lx + 17, y=legend_y)}>swap: owner asked → owner holds the '
               'GPU</text>')
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _clock(at: float, *, date: bool = False, seconds: bool = True) -> str:
    fmt = ("%Y-%m-%d " if date else "") + ("%H:%M:%S" if seconds else "%H:%M")
    return time.strftime(fmt, time.localtime(at))
