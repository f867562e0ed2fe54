"""`<run dir>/pipetrain.log`: what the terminal showed, kept with the run.

The launching process tees its own stdout and stderr at the file-descriptor level: fds 1 and 2
become the write ends of a pipe (a pseudo-terminal where they were a terminal, so rich still
draws its colours and the live bar there), and one thread per stream copies what arrives to the
original stream and, as plain lines, to the log. Everything the terminal gets passes through:
this process's prints, the ranks it starts (they write to the launcher's fds 1 and 2, handed to
them at launch: launch/forkserver.py `Inherit`), and C++ (gloo, Kineto). The log is flushed per
line, so a killed run keeps what it showed; it is appended to, so a resumed run's segments follow
each other, each after a `$ pipetrain ...` line.

Plain lines: ANSI escape codes are dropped, and of a line that carriage returns redrew (a
progress bar) only what was drawn last is kept. Kineto's `USDT:` lines, printed at every
profiler start and stop, go to the log only (CHATTER).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import re
import select
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

LOG_FILE = "pipetrain.log"
# Line starts that are chatter: kept out of the terminal, kept in the log. Kineto prints
# `USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start` whatever
# KINETO_LOG_LEVEL says (torch 2.13).
CHATTER = (b"USDT:",)
# CSI (colours, cursor moves, erase line), OSC (hyperlinks, titles) and two-byte escapes.
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")
CURSOR_UP = re.compile(r"\x1b\[(\d*)A")
POLL_S = 0.05  # how long a stopping tee waits for more of what a child wrote before it ends


def plain(line: str) -> tuple[int, str]:
    """One line as it reads once the terminal drew it, and how many lines above it its escape
    codes erased (rich's transient progress bar: cursor up, erase line). What counts is what
    follows its last carriage return (what a redraw left), without escape codes."""
    line = line.rstrip("\r")
    line = line[line.rfind("\r") + 1:]
    lead = ANSI.match(line)
    erased = 0
    while lead:  # the escapes before the text: cursor moves among them
        up = CURSOR_UP.fullmatch(lead.group())
        erased += int(up.group(1) or 1) if up else 0
        lead = ANSI.match(line, lead.end())
    return erased, ANSI.sub("", line)


class PlainLog:
    """The log file both streams write plain lines to, flushed per line. Append-only but for a
    line that cursor moves erased from the terminal, which goes from the log too."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("ab")
        self.lock = threading.Lock()
        self.starts: collections.deque[int] = collections.deque(maxlen=16)  # offsets of the last lines
        self.size = self.file.seek(0, os.SEEK_END)

    def write(self, raw: Sequence[bytes]) -> None:
        with self.lock:
            for line in raw:
                erased, text = plain(line.decode("utf-8", "replace"))
                erased = min(erased, len(self.starts))
                if erased:
                    self.size = self.starts[-erased]
                    for _ in range(erased):
                        self.starts.pop()
                    self.file.truncate(self.size)
                if text or not line.strip(b"\r"):  # a line of escape codes only: none
                    self.starts.append(self.size)
                    data = (text + "\n").encode()
                    self.file.write(data)
                    self.size += len(data)
            self.file.flush()

    def close(self) -> None:
        self.file.close()


class ChatterFilter:
    """What of a stream the terminal gets: every byte as it comes, except whole lines that start
    with CHATTER. A line's first bytes are held only while they could still turn into chatter, so
    a prompt or a progress bar without a newline is never delayed."""

    def __init__(self) -> None:
        self.held = b""  # the start of the current line, while it may be chatter
        self.state = "start"  # start (of a line) | pass (the rest of a shown line) | drop (of chatter)

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for piece in _lines(data):
            ends = piece.endswith(b"\n")
            if self.state == "start":
                line, self.held = self.held + piece, b""
                if line.startswith(CHATTER):
                    self.state = "drop"
                elif not ends and any(c.startswith(line) for c in CHATTER):
                    self.held = line
                    continue
                else:
                    out += line
                    self.state = "pass"
            elif self.state == "pass":
                out += piece
            if ends:
                self.state = "start"
        return bytes(out)

    def flush(self) -> bytes:
        """What is held at the end (a line's start that never went on)."""
        held, self.held = self.held, b""
        return held


def _lines(data: bytes) -> list[bytes]:
    """data cut after each newline (the pieces keep it; the last may have none)."""
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


class _LogLines:
    """Bytes of one stream -> whole lines into the shared PlainLog."""

    def __init__(self, log: PlainLog) -> None:
        self.log, self.buf = log, b""

    def feed(self, data: bytes) -> None:
        *lines, self.buf = (self.buf + data).split(b"\n")
        cut = self.buf.rfind(b"\r", 0, len(self.buf) - 1)  # a bar redrawn without a newline: its last drawing
        if cut > 0:
            self.buf = self.buf[cut:]
        if lines:
            self.log.write(lines)

    def close(self) -> None:
        if self.buf:
            self.log.write([self.buf])
            self.buf = b""


class _Stream:
    """fd (1 or 2) teed: its original saved, a pipe or pseudo-terminal in its place, and the
    thread that copies what arrives to the original and the log."""

    def __init__(self, fd: int, log: PlainLog) -> None:
        self.fd, self.original = fd, os.dup(fd)
        self.pty: Optional[int] = None  # the pseudo-terminal's writing side, kept to copy resizes onto
        if os.isatty(fd):
            self.read_fd, self.pty = os.openpty()
            _raw_output(self.pty)
            _copy_size(self.original, self.pty)
            os.dup2(self.pty, fd)
        else:
            self.read_fd, write_fd = os.pipe()
            os.dup2(write_fd, fd)
            os.close(write_fd)
        self.chatter, self.lines = ChatterFilter(), _LogLines(log)
        self.forward = True
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._pump, name=f"pipetrain-tee-{fd}", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        while True:
            # Read before the wait, not after: a wait that timed out may be acted on only after
            # restore() ran (this thread waits for the GIL while the main thread prints its last
            # line and restores), and that last line came after the wait began. Only a wait that
            # began once stopping was set, and saw nothing for POLL_S, ends the tee.
            stopping = self.stopping.is_set()
            ready, _, _ = select.select([self.read_fd], [], [], POLL_S)
            if not ready:
                if stopping:
                    break
                continue
            try:
                data = os.read(self.read_fd, 1 << 16)
            except OSError:  # a pseudo-terminal whose every writer closed it
                data = b""
            if not data:
                break
            self._show(self.chatter.feed(data))
            self.lines.feed(data)
        self._show(self.chatter.flush())
        self.lines.close()

    def _show(self, data: bytes) -> None:
        if not (self.forward and data):
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.original, view):]
        except OSError:  # the terminal or the pipe went away (`| head`): the log goes on
            self.forward = False

    def restore(self) -> None:
        """The fd back to its original (this process's later prints go straight there); what is
        still on its way through the pipe is read until it has been quiet for POLL_S."""
        os.dup2(self.original, self.fd)
        self.stopping.set()

    def close(self) -> None:
        self.thread.join()
        for fd in (self.read_fd, self.original, self.pty):
            if fd is not None:
                os.close(fd)


@contextlib.contextmanager
def console_log(run_dir: Path, argv: Sequence[str] = ()) -> Iterator[Optional[Path]]:
    """Tee this process's stdout and stderr into `<run_dir>/pipetrain.log` (appended to, after a
    `$ pipetrain ARGS` line) while the block runs; yields the log's path (None where the run
    directory cannot take a file: the run's own checks say so, and nothing is teed)."""
    path = Path(run_dir) / LOG_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = PlainLog(path)
    except OSError:
        yield None
        return
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    log.write([f"{' '.join(['$ pipetrain', *argv])}  # {stamp}".encode()])
    _flush_std()
    streams = [_Stream(fd, log) for fd in (1, 2) if _is_open(fd)]
    unfollow = _follow_resizes([s for s in streams if s.pty is not None])
    try:
        yield path
    except Exception as err:
        # A bug (a user's mistake ends in one line and SystemExit): Hydra prints its traceback
        # after the tee has ended, so the log gets it here.
        _flush_std()
        text = "".join(traceback.format_exception(err)).rstrip("\n")
        log.write([line.encode() for line in text.split("\n")])
        raise
    finally:
        _flush_std()
        unfollow()
        for s in streams:
            s.restore()
        for s in streams:
            s.close()
        log.close()


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or replaced stream
            stream.flush()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _raw_output(fd: int) -> None:
    """No output processing on the pseudo-terminal (its `\\n` would come out as `\\r\\n`): the
    real terminal does its own."""
    import termios

    attrs = termios.tcgetattr(fd)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(fd, termios.TCSANOW, attrs)


def _copy_size(src: int, dst: int) -> None:
    """The real terminal's rows and columns onto the pseudo-terminal (rich sizes its tables by them)."""
    import fcntl
    import termios

    with contextlib.suppress(OSError):
        fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))


def _follow_resizes(streams: Sequence[_Stream]) -> Callable[[], None]:
    """A resized terminal's size copied onto the pseudo-terminals (SIGWINCH; only the main thread
    may set a handler). Returns what puts the previous handler back."""
    if not streams or threading.current_thread() is not threading.main_thread():
        return lambda: None

    def resized(signum: int, frame: object) -> None:
        for s in streams:
            if s.pty is not None:
                _copy_size(s.original, s.pty)

    previous = signal.signal(signal.SIGWINCH, resized)
    return lambda: signal.signal(signal.SIGWINCH, previous if previous is not None else signal.SIG_DFL)
