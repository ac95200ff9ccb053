/* Preloaded into bubblewrap (LD_PRELOAD) when the sandbox starts it as root: its one call of
 * prctl(PR_SET_NO_NEW_PRIVS, 1) does nothing, so /proc/self/status inside reads
 * "NoNewPrivs: 0", as it does for every process of a laptop's session. Every other prctl
 * goes to the kernel unchanged.
 *
 * What no_new_privs would guard stays guarded without it. bubblewrap mounts every bind, tmpfs,
 * /proc and /dev of the sandbox nosuid (and nodev), and the kernel ignores set-user-ID,
 * set-group-ID and file capabilities on a nosuid mount, so no program the user runs gains any
 * privilege (tests/test_security_sandbox.py runs setuid-root and setgid-root binaries, sudo
 * and su, and finds every set-id file on a nosuid mount). The user holds no capability and
 * the sandbox loads no seccomp filter, so there is nothing else for the flag to keep.
 *
 * Only a root caller's bubblewrap loads it: a set-user-ID bubblewrap runs in secure-execution
 * mode, where the loader ignores LD_PRELOAD; and for any other caller the flag is set as asked.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

int prctl(int option, ...) {
    va_list ap;
    unsigned long a[4];
    va_start(ap, option);
    for (int i = 0; i < 4; i++) a[i] = va_arg(ap, unsigned long);
    va_end(ap);
    if (option == PR_SET_NO_NEW_PRIVS && a[0] == 1 && getuid() == 0 && geteuid() == 0) return 0;
    return (int)syscall(SYS_prctl, option, a[0], a[1], a[2], a[3]);
}
