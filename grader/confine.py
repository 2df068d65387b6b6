"""Confinement of a grading worker: what it may still do once its imports are done.

`confine(keep_fd)` makes code that somehow ran inside the worker useless: it can start no process,
create, grow, rename or delete no file, open no socket, signal or trace no other process, push no
input into a terminal, change nothing system-wide, raise none of its own limits, use no I/O port, keyring,
SysV IPC or message queue, and it holds a bounded amount of memory and no descriptor but stdin and `keep_fd`
(stdout and stderr become /dev/null). Linux only; the syscall filter (seccomp) needs x86_64 or aarch64, elsewhere only the
resource limits and the descriptor hygiene apply, and `confine` says so in its result.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
import struct
import sys

MEMORY_LIMIT_BYTES = 4 << 30
_OPEN_FILES = 64  # lazy imports still read modules after confinement

# Denied outright (fail with EPERM). open/openat are denied only with a flag that writes or creates.
_DENIED = (
    "fork", "vfork", "clone", "clone3", "execve", "execveat",  # new processes or programs
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open", "pidfd_send_signal",
    "ptrace", "process_vm_readv", "process_vm_writev",
    "socket", "socketpair",
    "openat2", "creat", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2",
    "link", "linkat", "symlink", "symlinkat", "mknod", "mknodat", "truncate", "ftruncate", "fallocate",
    "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat", "utime", "utimes", "utimensat",
    "futimesat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "memfd_create", "mount", "umount2", "chroot", "pivot_root", "unshare", "setns", "io_uring_setup", "bpf",
    "open_by_handle_at", "reboot", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "swapon", "swapoff", "sethostname", "setdomainname", "settimeofday", "clock_settime", "acct",
    "setrlimit", "iopl", "ioperm", "keyctl", "add_key", "request_key",  # lift its own limits; ports; keyrings
    "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop",  # SysV IPC, message queues
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
    "mq_getsetattr",
)
# prlimit64 is denied only with a new limit (its third argument not NULL): reading a limit stays allowed.
_SET_LIMIT = "prlimit64"
# ioctl requests refused: TIOCSTI (type into a terminal) and TIOCLINUX (the same on a Linux console).
_DENIED_IOCTLS = (0x5412, 0x541C)
# (audit arch, {syscall: number}, {open-like syscall: index of its flags argument})
_X86_64 = (0xC000003E, {
    "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "execve": 59, "execveat": 322, "kill": 62,
    "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "pidfd_open": 434,
    "pidfd_send_signal": 424, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "socket": 41, "socketpair": 53, "openat2": 437, "creat": 85, "mkdir": 83, "mkdirat": 258, "rmdir": 84,
    "unlink": 87, "unlinkat": 263, "rename": 82, "renameat": 264, "renameat2": 316, "link": 86,
    "linkat": 265, "symlink": 88, "symlinkat": 266, "mknod": 133, "mknodat": 259, "truncate": 76,
    "ftruncate": 77, "fallocate": 285, "chmod": 90, "fchmod": 91, "fchmodat": 268, "chown": 92,
    "fchown": 93, "lchown": 94, "fchownat": 260, "utime": 132, "utimes": 235, "utimensat": 280,
    "futimesat": 261, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197,
    "lremovexattr": 198, "fremovexattr": 199, "memfd_create": 319, "mount": 165, "umount2": 166,
    "chroot": 161, "pivot_root": 155, "unshare": 272, "setns": 308, "io_uring_setup": 425, "bpf": 321,
    "open_by_handle_at": 304, "reboot": 169, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "kexec_load": 246, "kexec_file_load": 320, "swapon": 167, "swapoff": 168, "sethostname": 170,
    "setdomainname": 171, "settimeofday": 164, "clock_settime": 227, "acct": 163, "ioctl": 16,
    "setrlimit": 160, "prlimit64": 302, "iopl": 172, "ioperm": 173, "keyctl": 250, "add_key": 248,
    "request_key": 249, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65,
    "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "mq_open": 240,
    "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
}, {2: 1, 257: 2})  # open(path, flags), openat(dirfd, path, flags)
_AARCH64 = (0xC00000B7, {
    "clone": 220, "clone3": 435, "execve": 221, "execveat": 281, "kill": 129, "tkill": 130, "tgkill": 131,
    "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240, "pidfd_open": 434, "pidfd_send_signal": 424,
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "socket": 198, "socketpair": 199,
    "openat2": 437, "mkdirat": 34, "unlinkat": 35, "renameat": 38, "renameat2": 276, "linkat": 37,
    "symlinkat": 36, "mknodat": 33, "truncate": 45, "ftruncate": 46, "fallocate": 47, "fchmod": 52,
    "fchmodat": 53, "fchownat": 54, "fchown": 55, "utimensat": 88, "setxattr": 5, "lsetxattr": 6,
    "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16, "memfd_create": 279,
    "mount": 40, "umount2": 39, "chroot": 51, "pivot_root": 41, "unshare": 97, "setns": 268,
    "io_uring_setup": 425, "bpf": 280, "open_by_handle_at": 265, "reboot": 142, "init_module": 105,
    "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "swapon": 224,
    "swapoff": 225, "sethostname": 161, "setdomainname": 162, "settimeofday": 170, "clock_settime": 112,
    "acct": 89, "ioctl": 29, "setrlimit": 164, "prlimit64": 261, "keyctl": 219, "add_key": 217,
    "request_key": 218, "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197, "semget": 190, "semop": 193,
    "semctl": 191, "semtimedop": 192, "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "mq_open": 180,
    "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185,
}, {56: 2})  # openat(dirfd, path, flags)
_ARCHES = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_X32_SYSCALL_BIT = 0x40000000

# Classic BPF, as seccomp reads it: struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}.
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _ERRNO_EPERM = 0x7FFF0000, 0x00050000 | 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def syscall_filter(arch: int, numbers: dict[str, int], open_flags: dict[int, int]) -> bytes:
    """The seccomp program: EPERM for the denied syscalls, for prlimit64 setting a limit, for open-likes with a
    write flag, for the denied ioctl requests, for another ABI; everything else allowed."""
    denied = sorted({numbers[name] for name in _DENIED if name in numbers})
    program = [_op(_LD_W_ABS, 4), _op(_JEQ_K, arch, jt=1), _op(_RET_K, _ERRNO_EPERM), _op(_LD_W_ABS, 0)]
    if arch == _X86_64[0]:
        program += [_op(_JGE_K, _X32_SYSCALL_BIT, jf=1), _op(_RET_K, _ERRNO_EPERM)]
    for nr in denied:
        program += [_op(_JEQ_K, nr, jf=1), _op(_RET_K, _ERRNO_EPERM)]
    # prlimit64? its new-limit pointer (both words) zero -> allow; else EPERM. Not prlimit64: skip these 7.
    program += [_op(_JEQ_K, numbers[_SET_LIMIT], jf=7), _op(_LD_W_ABS, 16 + 8 * 2), _op(_JEQ_K, 0, jt=1),
                _op(_RET_K, _ERRNO_EPERM), _op(_LD_W_ABS, 16 + 8 * 2 + 4), _op(_JEQ_K, 0, jf=1), _op(_RET_K, _ALLOW),
                _op(_RET_K, _ERRNO_EPERM)]
    for nr, arg in open_flags.items():
        # nr? load the flags' low word; a write flag -> EPERM; else allow. Not nr: skip these 4.
        program += [_op(_JEQ_K, nr, jf=4), _op(_LD_W_ABS, 16 + 8 * arg), _op(_JSET_K, _WRITE_FLAGS, jf=1),
                    _op(_RET_K, _ERRNO_EPERM), _op(_RET_K, _ALLOW)]
    # ioctl? load its request; a denied one -> EPERM; else allow. Not ioctl: skip to the final allow.
    tiocsti, tioclinux = _DENIED_IOCTLS
    program += [_op(_JEQ_K, numbers["ioctl"], jf=5), _op(_LD_W_ABS, 16 + 8 * 1), _op(_JEQ_K, tiocsti, jt=2),
                _op(_JEQ_K, tioclinux, jt=1), _op(_RET_K, _ALLOW), _op(_RET_K, _ERRNO_EPERM)]
    program.append(_op(_RET_K, _ALLOW))
    return b"".join(program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _install_filter() -> bool:
    table = _ARCHES.get(platform.machine().lower())
    if table is None or not sys.platform.startswith("linux"):
        return False
    program = syscall_filter(*table)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0


def _lower_limit(kind: int, value: int) -> None:
    soft, hard = resource.getrlimit(kind)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))


def confine(keep_fd: int) -> dict[str, bool]:
    """Confine this process for good (see the module docstring); returns which layers took effect."""
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    keep = {0, 1, 2, keep_fd}
    for fd in map(int, os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else range(3, 1024):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the size limit fails instead of killing
    _lower_limit(resource.RLIMIT_AS, MEMORY_LIMIT_BYTES)
    _lower_limit(resource.RLIMIT_FSIZE, 0)
    _lower_limit(resource.RLIMIT_NPROC, 0)  # ignored for root, hence the syscall filter
    _lower_limit(resource.RLIMIT_CORE, 0)
    _lower_limit(resource.RLIMIT_NOFILE, _OPEN_FILES)
    return {"limits": True, "syscall_filter": _install_filter()}
