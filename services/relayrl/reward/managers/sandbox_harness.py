"""Child side of the `sandbox` reward manager (`relayrl.reward.managers.sandbox`).

The manager starts `python -I -B -X utf8 [-S] sandbox_harness.py RESULT_FD` in a new session
and a fresh work dir, writes one JSON job to its stdin and closes it. This script then:

1. hardens its own process while it still runs only trusted code: a private network namespace,
   resource limits, a uid of its own (when started as root), RLIMIT_NPROC, no_new_privs, and
   death with the service;
2. compiles the tests (trusted), installs an audit hook that blocks process creation, network
   access, ctypes, signals, rlimit changes and writes outside the work dir, and reports
   `started`;
3. runs the candidate's code as module `solution`, then each test in that module's namespace,
   reporting each outcome the moment it is known (a run the manager kills half-way still tells
   which tests passed).

Reports are lines `<nonce> <json>` on RESULT_FD, never on stdout or stderr, which belong to the
candidate. The manager ignores every line without the nonce, and the candidate is never given
the nonce, so printing (or writing to RESULT_FD) a fake result cannot forge a pass. Code that
digs the nonce out of this process's memory could; an in-process runner cannot prevent that,
which is why the OS layers, not this script, are what contain the code.

Everything before `started` is the sandbox's responsibility (its failures are INFRA_ERROR);
everything after it is the candidate's. Only the standard library is used: the child may run
another interpreter than the service, usually without site-packages.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import signal
import sys
import types
from json.encoder import encode_basestring_ascii  # bound now: the candidate may patch `json`
from typing import Any, NoReturn

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522
EXIT_SETUP_FAILED = 3
EXIT_HARNESS_FAILED = 4
# Longest exception message reported per test; keeps the result channel small.
MESSAGE_CHARS = 2000
# Freed when the candidate runs out of memory, so that reporting the MemoryError has room.
MEMORY_RESERVE_BYTES = 1 << 20
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
ALWAYS_WRITABLE = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr"})

FORK_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.posix_spawnp",
        "os.exec",
        "os.spawn",
        "os.system",
        "os.startfile",
        "pty.spawn",
        "subprocess.Popen",
    }
)
NETWORK_EVENTS = frozenset(
    {
        "socket.bind",
        "socket.connect",
        "socket.getaddrinfo",
        "socket.gethostbyaddr",
        "socket.gethostbyname",
        "socket.getnameinfo",
        "socket.sendmsg",
        "socket.sendto",
        "socket.sethostname",
    }
)
SIGNAL_EVENTS = frozenset({"os.kill", "os.killpg", "signal.pthread_kill"})
LIMIT_EVENTS = frozenset({"resource.setrlimit", "resource.prlimit"})
# Events that change the file system: (index of a path argument, index of its dir_fd or None).
PATH_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.chflags": ((0, None),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.link": ((1, 3),),
    "os.mkdir": ((0, 2),),
    "os.remove": ((0, 1),),
    "os.removexattr": ((0, None),),
    "os.rename": ((0, 2), (1, 3)),
    "os.rmdir": ((0, 1),),
    "os.setxattr": ((0, None),),
    "os.symlink": ((1, 2),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
}


class SandboxViolation(BaseException):
    """Raised into the candidate's code when it does something the sandbox forbids. A
    BaseException, so `except Exception` does not swallow it; the violation is reported the
    moment it happens anyway, so swallowing it gains the candidate nothing."""


class Channel:
    """Writes `<nonce> <json>` lines to the result fd. The string encoder and os.write are
    bound at import time, so a candidate that patches `json` or `os` does not garble the
    reports."""

    def __init__(self, fd: int, nonce: str) -> None:
        self._fd = fd
        self._prefix = (nonce + " ").encode("ascii")
        self._write = os.write

    def send(self, event: str, **fields: object) -> None:
        parts = ['"event":' + encode_basestring_ascii(event)]
        parts.extend(encode_basestring_ascii(k) + ":" + _encode(v) for k, v in fields.items())
        data = self._prefix + ("{" + ",".join(parts) + "}\n").encode("ascii")
        while data:
            data = data[self._write(self._fd, data) :]


def _encode(value: object) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is str:
        return encode_basestring_ascii(value)
    if type(value) in (list, tuple):
        return "[" + ",".join(_encode(item) for item in value) + "]"  # type: ignore[attr-defined]
    raise TypeError(f"cannot report a {type(value).__name__}")


def _plain(value: object, limit: int = MESSAGE_CHARS) -> str:
    """An exact `str` of at most `limit` characters: an exception's message comes from the
    candidate's code and may be a str subclass with its own __repr__ or slicing."""
    try:
        text = str.__str__(value)  # type: ignore[arg-type]
    except TypeError:
        return "<not a string>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(exc: BaseException) -> dict[str, object]:
    """Type name, message and whether it was a MemoryError. The message runs the candidate's
    __str__, which may itself fail; that must not take the harness down."""
    try:
        exc_type = _plain(type(exc).__name__, 200)
    except BaseException:  # a hostile metaclass; the report still goes out
        exc_type = "<unnamed exception>"
    try:
        if isinstance(exc, SyntaxError):
            message = f"{_plain(exc.msg)} (line {exc.lineno})"
        else:
            message = _plain(str(exc))
    except BaseException:  # the candidate's __str__ failed; report the type alone
        message = "<unprintable message>"
    return {"exc_type": exc_type, "message": message, "memory": isinstance(exc, MemoryError)}


class Libc:
    """The few system calls Python 3.11 has no wrapper for."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL(None, use_errno=True)
        self._lib.unshare.argtypes = [ctypes.c_int]
        ulong = ctypes.c_ulong
        self._lib.prctl.argtypes = [ctypes.c_int, ulong, ulong, ulong, ulong]

    def unshare(self, flags: int) -> None:
        self._check("unshare", self._lib.unshare(flags))

    def prctl(self, option: int, arg: int) -> None:
        self._check("prctl", self._lib.prctl(option, arg, 0, 0, 0))

    def drop_capabilities(self) -> None:
        """Clear every capability (a new user namespace grants them all inside it)."""

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inh")]

        header = Header(LINUX_CAPABILITY_VERSION_3, 0)
        data = (Data * 2)()
        self._check("capset", self._lib.capset(ctypes.byref(header), data))

    @staticmethod
    def _check(name: str, result: int) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _write_proc(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def isolate_network(libc: Libc) -> tuple[str | None, str | None]:
    """Move into a network namespace of our own (no interfaces but a loopback that is down).
    As root that is one unshare; as another user it needs a user namespace first, mapping only
    our own uid and gid. Returns (layer, None) or (None, why it was not possible)."""
    try:
        libc.unshare(CLONE_NEWNET)
        return "netns", None
    except OSError as exc:
        plain = exc
    if os.geteuid() == 0:
        return None, f"unshare(CLONE_NEWNET) failed: {plain}"
    uid, gid = os.getuid(), os.getgid()
    try:
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
    except OSError as exc:
        return None, f"unshare(CLONE_NEWNET) failed: {plain}; with CLONE_NEWUSER: {exc}"
    # Unmapped ids cannot create files, so map ours onto themselves; then give up the
    # capabilities the new namespace granted.
    _write_proc("/proc/self/setgroups", "deny")
    _write_proc("/proc/self/uid_map", f"{uid} {uid} 1")
    _write_proc("/proc/self/gid_map", f"{gid} {gid} 1")
    libc.drop_capabilities()
    return "userns+netns", None


def reachable(path: str, uid: int, gid: int) -> bool:
    """Whether `uid`/`gid` may list `path` and search every directory above it, by mode bits
    (ACLs ignored: at worst a reachable directory is rerouted needlessly)."""
    parts = [part for part in os.path.realpath(path).split(os.sep) if part]
    dirs = ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
    for index, directory in enumerate(dirs):
        need = 0o5 if index == len(dirs) - 1 else 0o1
        st = os.stat(directory)
        if st.st_uid == uid:
            bits = st.st_mode >> 6
        elif st.st_gid == gid:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        if bits & need != need:
            return False
    return True


def reroute_import_paths(uid: int, gid: int) -> None:
    """Keep the interpreter's library importable after the uid drop when it lies under a
    private directory (a pyenv under /root): open each unreachable sys.path directory now, as
    root, and import through /proc/self/fd/N, which needs no search permission on the
    directories above it. Packages already imported get their __path__ moved too."""
    moved: dict[str, str] = {}
    for index, entry in enumerate(sys.path):
        if not entry or not os.path.isdir(entry) or reachable(entry, uid, gid):
            continue
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
        moved[entry] = f"/proc/self/fd/{fd}"
        sys.path[index] = moved[entry]
    if not moved:
        return

    def move(path: str) -> str:
        for old, new in moved.items():
            if path == old or path.startswith(old + os.sep):
                return new + path[len(old) :]
        return path

    for module in list(sys.modules.values()):
        package_path = getattr(module, "__path__", None)
        if isinstance(package_path, list):
            package_path[:] = [move(path) for path in package_path]
    sys.path_importer_cache.clear()


def set_limit(which: int, soft: int, hard: int | None = None) -> None:
    """Lower a resource limit (never above the hard limit we were started with)."""
    hard = soft if hard is None else hard
    _, current_hard = resource.getrlimit(which)
    if current_hard != resource.RLIM_INFINITY:
        hard = min(hard, current_hard)
    resource.setrlimit(which, (min(soft, hard), hard))


def harden(job: dict[str, Any], libc: Libc) -> tuple[list[str], list[str]]:
    """Apply every OS layer the job asks for; returns (active layers, warnings). A network
    namespace the kernel refuses (a non-root pod whose runtime forbids user namespaces)
    raises unless the job allows running without one (`require_network_isolation: false`:
    then it is a warning and the audit guard alone blocks sockets); any other layer failing
    raises, so the run never goes ahead weaker than configured without anyone knowing."""
    layers: list[str] = []
    warnings: list[str] = []
    uid, gid = job["uid"], job["gid"]
    if job["isolate_network"]:
        layer, problem = isolate_network(libc)
        if layer is not None:
            layers.append(layer)
        elif job.get("require_network_isolation", True):
            raise RuntimeError(
                f"no private network namespace ({problem}); candidate code does not run "
                "without one: run the reward-service as root or where user namespaces are "
                "allowed, or set sandbox require_network_isolation: false (trusted code only)"
            )
        else:
            warnings.append(f"no private network namespace ({problem})")
    if uid is not None:
        reroute_import_paths(uid, gid)

    set_limit(resource.RLIMIT_CORE, 0)
    set_limit(resource.RLIMIT_FSIZE, job["max_file_bytes"])
    set_limit(resource.RLIMIT_NOFILE, job["max_open_files"])
    set_limit(resource.RLIMIT_AS, job["memory_limit_bytes"])
    # RLIMIT_CPU counts from process start: add the startup's CPU seconds. The hard limit one
    # second later kills a candidate that ignores SIGXCPU.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_soft = math.ceil(usage.ru_utime + usage.ru_stime) + job["cpu_limit_s"]
    set_limit(resource.RLIMIT_CPU, cpu_soft, cpu_soft + 1)
    layers.append("rlimits")

    if uid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
            raise RuntimeError(f"dropping to uid {uid}/gid {gid} did not take")
        # The uid is this sandbox's alone, so being dumpable (which keeps /proc/self ours, and
        # /proc/self/fd is how a rerouted library is read) exposes nothing to anyone else.
        libc.prctl(PR_SET_DUMPABLE, 1)
        layers.append(f"uid:{uid}")
    set_limit(resource.RLIMIT_NPROC, job["max_processes"])
    if os.geteuid() != 0:  # root ignores RLIMIT_NPROC
        layers.append("nproc")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
    layers.append("no_new_privs")
    # Die with the service (set after the uid change, which clears it), and make sure it has
    # not died already.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != job["parent_pid"]:
        raise RuntimeError("the service exited while the sandbox started")
    os.umask(0o077)
    # By its absolute path: HOME, TMPDIR and tempfile use that, not the cwd.
    if not os.access(job["workdir"], os.W_OK | os.X_OK):
        raise RuntimeError(f"the work dir {job['workdir']} is not writable by uid {os.getuid()}")
    return layers, warnings


def install_guard(channel: Channel, workdir: str) -> None:
    """The in-process layer: an audit hook (which cannot be removed once added) that refuses
    what the OS layers also refuse, with a clear reason, and what they cannot express (writes
    outside the work dir are best effort: an open() relative to a directory fd is not seen)."""
    violated: list[str] = []
    busy: list[bool] = [False]

    def block(category: str, detail: str) -> NoReturn:
        if not violated:
            violated.append(category)
            channel.send("violation", category=category, detail=_plain(detail, 300))
        raise SandboxViolation(f"blocked by the sandbox: {category} ({detail})")

    def outside(path: object, dir_fd: object) -> str | None:
        if isinstance(path, int):
            return None  # an fd: its open() was checked
        try:
            name = os.fsdecode(os.fspath(path))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return repr(path)
        if name in ALWAYS_WRITABLE:
            return None
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(name):
            name = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
        real = os.path.realpath(name)
        if real == workdir or real.startswith(workdir + os.sep):
            return None
        return real

    def check_paths(event: str, args: tuple[Any, ...]) -> None:
        for path_index, fd_index in PATH_EVENTS[event]:
            dir_fd = args[fd_index] if fd_index is not None and fd_index < len(args) else None
            where = outside(args[path_index], dir_fd) if path_index < len(args) else None
            if where is not None:
                block("file", f"{event} {where}")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if busy[0]:
            return
        busy[0] = True
        try:
            if event == "open":
                mode, flags = args[1], args[2]
                writes = isinstance(flags, int) and flags & WRITE_FLAGS
                if isinstance(mode, str) and any(c in mode for c in "wax+"):
                    writes = True
                if writes:
                    where = outside(args[0], None)
                    if where is not None:
                        block("file", f"write to {where}")
            elif event in PATH_EVENTS:
                check_paths(event, args)
            elif event in FORK_EVENTS:
                block("fork", event)
            elif event in NETWORK_EVENTS:
                block("network", event)
            elif event in SIGNAL_EVENTS:
                block("signal", event)
            elif event in LIMIT_EVENTS:
                block("rlimit", event)
            elif event.startswith("ctypes."):
                block("ctypes", event)
        finally:
            busy[0] = False

    # subprocess's fork_exec raises no audit event of its own.
    import _posixsubprocess

    def fork_exec(*args: object, **kwargs: object) -> NoReturn:
        block("fork", "_posixsubprocess.fork_exec")

    _posixsubprocess.fork_exec = fork_exec  # type: ignore[attr-defined]
    sys.addaudithook(hook)


def run_candidate(job: dict[str, Any], channel: Channel, tests: list[types.CodeType]) -> None:
    """Run the candidate as module `solution`, then each test in its namespace. Every failure
    of candidate code is caught here (BaseException: SystemExit, MemoryError and the sandbox's
    own violations included) and reported as that step's outcome."""
    reserve = [bytearray(MEMORY_RESERVE_BYTES)]
    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    sys.modules["__main__"] = module  # `import __main__` must not reach the harness

    def report_failure(event: str, exc: BaseException, **fields: object) -> None:
        if isinstance(exc, MemoryError):
            reserve.clear()
        channel.send(event, **fields, **describe(exc))
        if not reserve:
            # Still out of memory: the next report goes without the reserve.
            with contextlib.suppress(MemoryError):
                reserve.append(bytearray(MEMORY_RESERVE_BYTES))

    try:
        code = compile(job["code"], "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        report_failure("candidate_error", exc, kind="syntax")
        return
    except BaseException as exc:  # MemoryError or RecursionError from a pathological source
        report_failure("candidate_error", exc, kind="exception")
        return
    try:
        exec(code, module.__dict__)
    except BaseException as exc:
        report_failure("candidate_error", exc, kind="exception")
        return
    channel.send("loaded")
    for index, test in enumerate(tests):
        try:
            exec(test, module.__dict__)
        except BaseException as exc:
            report_failure("test", exc, index=index, passed=False)
        else:
            channel.send("test", index=index, passed=True)


def main() -> None:
    result_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.buffer.read())
    channel = Channel(result_fd, job["nonce"])
    try:
        layers, warnings = harden(job, Libc())
        tests = [
            compile(source, f"<test {index + 1}>", "exec", dont_inherit=True)
            for index, source in enumerate(job["tests"])
        ]
        if job["audit_guard"]:
            install_guard(channel, os.path.realpath(job["workdir"]))
            layers.append("audit_guard")
    except Exception as exc:  # reported as the sandbox's failure, not the candidate's
        channel.send("infra_error", message=_plain(f"{type(exc).__name__}: {exc}"))
        os._exit(EXIT_SETUP_FAILED)
    stdout, stderr = sys.stdout, sys.stderr
    sys.argv = ["solution.py"]
    channel.send("started", layers=layers, warnings=warnings)
    try:
        run_candidate(job, channel, tests)
        channel.send("done")
    except BaseException as exc:  # a harness bug: candidate failures are caught per step
        try:
            channel.send("harness_error", message=_plain(f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(EXIT_HARNESS_FAILED)
    for stream in (stdout, stderr):
        # The candidate may have broken its streams; its output is diagnostics only.
        with contextlib.suppress(BaseException):
            stream.flush()
    # Skip atexit handlers, finalizers and non-daemon threads the candidate may have left.
    os._exit(0)


if __name__ == "__main__":
    main()
