"""Running a load from the command line: the progress bar and the report tables."""

from __future__ import annotations

import os

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from aiogguf._api import load
from aiogguf._config import Config
from aiogguf._events import Progress as LoadProgress
from aiogguf._events import Stage
from aiogguf._report import LoadReport
from aiogguf._run import run
from aiogguf._units import counted, format_bytes
from aiogguf.errors import shown_path

__all__ = ["byte_columns", "load_with_progress", "render_report"]


def byte_columns() -> tuple[ProgressColumn, ...]:
    """The columns of a progress bar in bytes: name, bar, bytes, GB/s, ETA."""
    return (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


def load_with_progress(
    path: str | os.PathLike[str], config: Config, console: Console
) -> LoadReport:
    """Load ``path`` showing a progress bar (bytes, GB/s, ETA); return the report. The
    bar appears once the load reads: a load that fails before (a missing file, a bad
    header, a placement refused) shows its one-line error alone."""
    # Shown as rich markup: a file's name is text, not styles, and not control characters.
    name = escape(shown_path(os.path.basename(os.fspath(path))))
    bar = Progress(*byte_columns(), console=console, transient=False)
    task: TaskID | None = None

    def on_progress(event: LoadProgress) -> None:
        nonlocal task
        if event.stage in (Stage.READ, Stage.DONE):
            if task is None:
                bar.start()
                task = bar.add_task(name, total=None)
            bar.update(task, completed=event.bytes_done, total=event.bytes_total or None)
        elif event.stage in (Stage.FAILED, Stage.CANCELLED) and task is not None:
            # The command's load is cancelled only by Ctrl-C (``interrupt_run``).
            ended = "failed" if event.stage is Stage.FAILED else "interrupted"
            bar.update(task, description=f"{name} ({ended})")

    async def go() -> LoadReport:
        async with load(path, config, progress=on_progress) as model:
            return model.report

    try:
        report: LoadReport = run(go)
    finally:
        if task is not None:  # a bar never started would still print its blank line
            bar.stop()
    return report


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "-"


def render_report(report: LoadReport, console: Console) -> None:
    """The final report: stages, buffers, files, and the headline throughput."""
    stages = Table(title="stages", title_justify="left")
    for col in ("stage", "wall s", "busy s", "items", "bytes", "GB/s"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for s in report.stages:
        stages.add_row(
            s.name,
            f"{s.wall_s:.3f}",
            f"{s.busy_s:.3f}",
            str(s.items),
            format_bytes(s.nbytes) if s.nbytes else "-",
            # Throughput only where bytes flow; allocation only reserves them.
            _gbps(s.nbytes, s.wall_s) if s.nbytes and s.name != "allocate" else "-",
        )
    buffers = Table(title="buffers", title_justify="left")
    for col in ("device", "buffer type", "lazy", "tensors", "size"):
        buffers.add_column(col, justify="right" if col in ("tensors", "size") else "left")
    for b in report.buffers:
        buffers.add_row(
            b.device,
            b.buffer_type,
            "yes" if b.lazy else "",
            str(b.n_tensors),
            format_bytes(b.nbytes),
        )
    files = Table(title="files", title_justify="left")
    for col in ("file", "disk", "direct", "reads", "bytes", "start s", "end s", "GB/s"):
        files.add_column(col, justify="left" if col in ("file", "disk") else "right")
    for f in report.files:
        files.add_row(
            escape(shown_path(os.path.basename(f.path))),
            f.disk,
            "yes" if f.direct else "",
            str(f.reads),
            format_bytes(f.nbytes),
            f"{f.start_s:.3f}",
            f"{f.end_s:.3f}",
            f"{f.gbps:.2f}",
        )
    console.print(stages, buffers, files)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    checked = f", {counted(report.validated, 'tensor')} validated" if report.validated else ""
    if report.blocks_hashed:
        checked += f", {counted(report.blocks_hashed, 'block matches', 'blocks match')}"
        checked += " the manifest"
    if report.tensors_hashed:
        checked += f", {counted(report.tensors_hashed, 'tensor matches', 'tensors match')}"
        checked += " the manifest"
    console.print(
        f"[bold green]loaded[/] {counted(report.n_tensors, 'tensor')}, "
        f"{format_bytes(report.nbytes)} "
        f"in {report.total_s:.3f} s = [bold]{report.gbps:.2f} GB/s[/] "
        f"(mode {report.mode}{checked})"
    )
