/* Process 1 of a sandbox, and the processes of the laptop session under it.
 *
 * bwrap runs this as process 1 of the sandbox's pid namespace, as root, from
 * /usr/lib/systemd (as "systemd", found on PATH). A model looking from inside sees a booted
 * laptop's process tree:
 *
 *   1     /sbin/init                       (comm "systemd"; reaps every orphan)
 *   3xx.. system services                  (sleeping; root or their own system user)
 *   11xx  /lib/systemd/systemd --user      (the user's manager, a child subreaper)
 *           (sd-pam), pipewire, ...        (the session's services, as the user)
 *           /usr/libexec/gnome-terminal-server
 *             bash                         (one a command: a child subreaper)
 *               the command                (as the user, with the caller's environment)
 *
 * The sandbox lives for a whole episode: the terminal serves the episode's commands, one at a
 * time, from a control socket the host holds (LAPTOP_INIT_CTL, a stream socket). A request is
 * a 4-byte length and that many bytes of NUL-terminated fields, with the command's stdin,
 * stdout and stderr passed along it (SCM_RIGHTS):
 *   R  cpu-soft cpu-hard as nproc fsize nofile cwd argc argv... envc env...   run
 *   K                                             kill the running command's whole tree
 * The terminal says "R\n" once the session is up; each command's bash says
 * "D <wait status> <user us> <system us> <left>\n" when the command returns (left: 1 if
 * processes it started still run). bash outlives its
 * command while the command's orphans (its daemons) live, reaping them; a kill takes every
 * process under it. When the host closes the socket the terminal exits, and with it the
 * session and process 1: the kernel then ends everything left in the namespace.
 *
 * Every process but the command is a fork of this one, titled with the command line a
 * laptop's process has (so /proc/N/cmdline reads like one) and named with PR_SET_NAME; it
 * sleeps and holds no descriptor but /dev/null. Each drops to its user before anything else
 * runs: the user's are then not dumpable, so their /proc/N/exe and environ are unreadable, as
 * a real daemon that hides them has; root's drop every capability. Only the command runs the
 * caller's program (exec'd, so it is an ordinary, dumpable process of the user).
 *
 * What to start comes in LAPTOP_INIT_* environment variables, which process 1 holds where the user
 * cannot read them and which the command never sees:
 *   LAPTOP_INIT_ROLE                init
 *   LAPTOP_INIT_UID, LAPTOP_INIT_GID, LAPTOP_INIT_GROUPS   the user, and its supplementary groups ("24,25,...")
 *   LAPTOP_INIT_SERVICES, LAPTOP_INIT_SESSION       one process a line: uid \t gid \t pid \t title; the
 *                                     comm is the title's program's base name unless the
 *                                     title starts with "comm=NAME "
 *   LAPTOP_INIT_MANAGER, LAPTOP_INIT_TERMINAL       a line each, the same format
 *   LAPTOP_INIT_CMD_PID             the pid the first command's bash should get
 *   LAPTOP_INIT_CTL                 the control socket's descriptor
 *   LAPTOP_INIT_DEV                 the laptop's /dev entries to make (see make_dev)
 * A pid is a hint: the next pid is set through /proc/sys/kernel/ns_last_pid where the kernel
 * allows it, so the tree's numbers look like those of a machine that has been up a while.
 *
 * Exit status: 0 once the host has closed the socket.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <stdint.h>
#include <unistd.h>

extern char **environ;

static void die(const char *what) {
    fprintf(stderr, "systemd: %s: %s\n", what, strerror(errno));
    _exit(126);
}

static const char *need(const char *key) {
    const char *v = getenv(key);
    if (!v) {
        fprintf(stderr, "systemd: %s is not set\n", key);
        _exit(126);
    }
    return v;
}

static void set_next_pid(long pid) {
    if (pid <= 1) return;
    int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%ld", pid - 1);
    if (write(fd, buf, n) < 0) { /* the kernel refused: pids stay sequential */ }
    close(fd);
}

static void become(uid_t uid, gid_t gid, const char *groups) {
    if (uid == 0) {  /* stay root, with no capability at all */
        struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct d[2];
        memset(d, 0, sizeof d);
        if (syscall(SYS_capset, &h, d) != 0) die("capset");
        return;
    }
    gid_t list[64];
    int n = 0;
    for (const char *p = groups; p && *p && n < 64;) {
        list[n++] = (gid_t)strtoul(p, (char **)&p, 10);
        if (*p == ',') p++;
        else break;
    }
    if (setgroups(n, list) != 0) die("setgroups");
    if (setresgid(gid, gid, gid) != 0) die("setresgid");
    if (setresuid(uid, uid, uid) != 0) die("setresuid");
}

static void quiet_fds(void) {
    int fd = open("/dev/null", O_RDWR);
    if (fd >= 0) {
        dup2(fd, 0);
        dup2(fd, 1);
        dup2(fd, 2);
        if (fd > 2) close(fd);
    }
    syscall(SYS_close_range, 3, ~0U, 0);
}

/* The memory /proc/N/cmdline is read from: argv's strings and, after them, the environment's.
 * A title at least as long as argv's strings ends past them, and the kernel then reads it up
 * to its NUL (as it does for every daemon that sets its title this way); bwrap starts this
 * binary as "systemd" (found on PATH) so that argv's strings are 8 bytes. */
static char *title_start, *title_end, *args_end;

static void set_title(const char *title) {
    size_t n = strlen(title), room = (size_t)(title_end - title_start);
    if (n >= room) n = room - 1;
    memcpy(title_start, title, n);
    memset(title_start + n, 0, room - n);
    /* a title shorter than argv's strings: the kernel would read all of them, the title and
     * NULs after it; with their last byte set it reads the title up to its NUL, as it does
     * for a longer one */
    if (title_start + n + 1 < args_end) args_end[-1] = ' ';
}

struct proc_line {
    uid_t uid;
    gid_t gid;
    long pid;
    char *comm;
    char *title;
};

static int parse_line(char *line, struct proc_line *p) {
    char *f[4];
    for (int i = 0; i < 4; i++) {
        f[i] = strsep(&line, "\t");
        if (!f[i]) return -1;
    }
    p->uid = (uid_t)strtoul(f[0], NULL, 10);
    p->gid = (gid_t)strtoul(f[1], NULL, 10);
    p->pid = strtol(f[2], NULL, 10);
    p->title = f[3];
    p->comm = NULL;
    if (strncmp(p->title, "comm=", 5) == 0) {
        p->comm = strsep(&p->title, " ") + 5;
        if (!p->title) return -1;
    }
    if (!*p->title) return -1;
    if (!p->comm) {  /* the program's base name */
        char *end = strchr(p->title, ' ');
        size_t len = end ? (size_t)(end - p->title) : strlen(p->title);
        char *prog = strndup(p->title, len), *slash = strrchr(prog, '/');
        p->comm = slash ? slash + 1 : prog;
    }
    return 0;
}

/* What every role reads, copied out of the environment before a title overwrites it. */
static struct {
    uid_t uid;
    gid_t gid;
    char *groups, *services, *session, *manager, *terminal;
    long cmd_pid;
    int ctl;          /* the control socket */
} spec;

static void read_spec(void) {
    spec.uid = (uid_t)strtoul(need("LAPTOP_INIT_UID"), NULL, 10);
    spec.gid = (gid_t)strtoul(need("LAPTOP_INIT_GID"), NULL, 10);
    spec.groups = strdup(getenv("LAPTOP_INIT_GROUPS") ? getenv("LAPTOP_INIT_GROUPS") : "");
    spec.services = strdup(getenv("LAPTOP_INIT_SERVICES") ? getenv("LAPTOP_INIT_SERVICES") : "");
    spec.session = strdup(getenv("LAPTOP_INIT_SESSION") ? getenv("LAPTOP_INIT_SESSION") : "");
    spec.manager = strdup(need("LAPTOP_INIT_MANAGER"));
    spec.terminal = strdup(need("LAPTOP_INIT_TERMINAL"));
    spec.cmd_pid = getenv("LAPTOP_INIT_CMD_PID") ? atol(getenv("LAPTOP_INIT_CMD_PID")) : 0;
    spec.ctl = atoi(need("LAPTOP_INIT_CTL"));
    if (spec.ctl < 3 || fcntl(spec.ctl, F_GETFD) < 0) {
        fprintf(stderr, "systemd: LAPTOP_INIT_CTL is not an open descriptor\n");
        _exit(126);
    }
}

/* The laptop's /dev entries (LAPTOP_INIT_DEV, one a line: "c|b|d MODE UID GID MAJOR MINOR PATH"
 * or "l TARGET PATH", paths under /dev), made on bubblewrap's nodev tmpfs, dated like its nodes. */
static void make_dev(const char *spec) {
    struct stat ref;
    struct timespec ts[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
    if (stat("/dev/null", &ref) == 0) {
        ts[0] = ref.st_atim;
        ts[1] = ref.st_mtim;
    }
    mode_t old = umask(0);
    char *copy = strdup(spec), *rest = copy, *line;
    while ((line = strsep(&rest, "\n")) != NULL) {
        char *f[7], *p = line, path[512];
        int n = 0;
        while (n < 7 && (f[n] = strsep(&p, " ")) != NULL) n++;
        if (n == 3 && f[0][0] == 'l') {
            snprintf(path, sizeof path, "/dev/%s", f[2]);
            if (symlink(f[1], path) != 0) continue;
        } else if (n == 7) {
            snprintf(path, sizeof path, "/dev/%s", f[6]);
            mode_t mode = (mode_t)strtoul(f[1], NULL, 8);
            dev_t dev = makedev(strtoul(f[4], NULL, 10), strtoul(f[5], NULL, 10));
            int r = f[0][0] == 'd' ? mkdir(path, mode)
                  : mknod(path, (f[0][0] == 'b' ? S_IFBLK : S_IFCHR) | mode, dev);
            if (r != 0) continue;
            if (lchown(path, (uid_t)strtoul(f[2], NULL, 10), (gid_t)strtoul(f[3], NULL, 10)) != 0) continue;
        } else {
            continue;
        }
        utimensat(AT_FDCWD, path, ts, AT_SYMLINK_NOFOLLOW);
    }
    free(copy);
    umask(old);
    /* then the directories, which the entries made in them touched, and bubblewrap's own */
    copy = strdup(spec);
    rest = copy;
    while ((line = strsep(&rest, "\n")) != NULL) {
        char path[512], *last = strrchr(line, ' ');
        if (line[0] == 'd' && last) {
            snprintf(path, sizeof path, "/dev/%s", last + 1);
            utimensat(AT_FDCWD, path, ts, AT_SYMLINK_NOFOLLOW);
        }
    }
    free(copy);
    static const char *own[] = {"core", "fd", "stdin", "stdout", "stderr", "ptmx", ""};
    for (int i = 0; own[i]; i++) {
        char path[64];
        snprintf(path, sizeof path, "/dev/%s", own[i]);
        utimensat(AT_FDCWD, path, ts, AT_SYMLINK_NOFOLLOW);
    }
}

static int status_code(int st) {
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return 1;
}

/* Wait for ``child``, reaping every other child meanwhile; return its exit status. */
static int reap_until(pid_t child) {
    for (;;) {
        int st;
        pid_t pid = wait(&st);
        if (pid == child) return status_code(st);
        if (pid < 0 && errno == ECHILD) return 1;
    }
}

/* Fork the process of a spec line, titled and named; returns in the child as its user (the
 * caller decides what it does) and in the parent with the child's pid. */
static pid_t fork_line(const char *spec_line, int as_user_now, int *is_child) {
    char *line = strdup(spec_line);
    struct proc_line p;
    if (!line || parse_line(line, &p) != 0) {
        fprintf(stderr, "systemd: bad process line: %s\n", spec_line);
        _exit(126);
    }
    set_next_pid(p.pid);
    pid_t pid = fork();
    if (pid < 0) die("fork");
    *is_child = pid == 0;
    if (pid == 0) {
        set_title(p.title);
        prctl(PR_SET_NAME, p.comm, 0, 0, 0);
        if (as_user_now) become(p.uid, p.gid, p.uid == spec.uid ? spec.groups : "");
    }
    return pid;
}

static void spawn_sleepers(const char *lines) {
    char *copy = strdup(lines), *rest = copy, *line;
    while ((line = strsep(&rest, "\n")) != NULL) {
        if (!*line) continue;
        int child;
        fork_line(line, 1, &child);
        if (child) {
            quiet_fds();
            for (;;) pause();
        }
    }
    free(copy);
}

static int read_full(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static void say(int fd, const char *msg, size_t n) {
    while (n) {
        ssize_t r = write(fd, msg, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return;
        msg += r;
        n -= (size_t)r;
    }
}

struct pp {
    pid_t pid, ppid;
};

static int by_pid(const void *a, const void *b) {
    pid_t x = ((const struct pp *)a)->pid, y = ((const struct pp *)b)->pid;
    return (x > y) - (x < y);
}

static long find_pid(const pid_t *pid, size_t n, pid_t want) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (pid[mid] < want) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && pid[lo] == want ? (long)lo : -1;
}

/* SIGKILL every process under ``root`` (not ``root``), round after round until none is left
 * alive: a process forking meanwhile is caught in a later round (RLIMIT_NPROC bounds them).
 * Orphans cannot leave the tree: ``root`` is their subreaper. */
static void kill_tree(pid_t root) {
    size_t cap = 4096;
    pid_t *pid = malloc(cap * sizeof *pid), *ppid = malloc(cap * sizeof *ppid);
    char *in = malloc(cap);
    if (!pid || !ppid || !in) return;
    for (int round = 0; round < 20000; round++) {
        size_t n = 0;
        DIR *d = opendir("/proc");
        if (!d) break;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
            char path[300], buf[512];
            snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;
            ssize_t r = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (r <= 0) continue;
            buf[r] = 0;
            char *close_paren = strrchr(buf, ')');
            if (!close_paren || close_paren[1] == 0) continue;
            char state = close_paren[2];
            if (state == 'Z' || state == 'X') continue;  /* dead: its parent reaps it */
            if (n == cap) {
                cap *= 2;
                pid = realloc(pid, cap * sizeof *pid);
                ppid = realloc(ppid, cap * sizeof *ppid);
                in = realloc(in, cap);
                if (!pid || !ppid || !in) { closedir(d); return; }
            }
            pid[n] = (pid_t)atol(e->d_name);
            ppid[n] = (pid_t)atol(close_paren + 4);
            n++;
        }
        closedir(d);
        /* the descendants of root, by parent links: sorted by pid, each chain walked up once */
        struct pp *v = malloc(n * sizeof *v + 1);
        if (!v) break;
        for (size_t i = 0; i < n; i++) v[i] = (struct pp){pid[i], ppid[i]};
        qsort(v, n, sizeof *v, by_pid);
        for (size_t i = 0; i < n; i++) pid[i] = v[i].pid, ppid[i] = v[i].ppid;
        free(v);
        memset(in, 0, n);  /* 0 unknown, 1 under root, 2 not */
        int found = 0;
        for (size_t i = 0; i < n; i++) {
            size_t k = i, depth = 0;
            char verdict = 0;
            while (!verdict && depth++ < n) {  /* up to a known answer */
                if (in[k]) verdict = in[k];
                else if (ppid[k] == root) verdict = 1;
                else {
                    long j = find_pid(pid, n, ppid[k]);
                    if (j < 0) verdict = 2;
                    else k = (size_t)j;
                }
            }
            if (!verdict) verdict = 2;
            for (k = i; !in[k];) {  /* the chain gets the answer */
                in[k] = verdict;
                if (ppid[k] == root) break;
                long j = find_pid(pid, n, ppid[k]);
                if (j < 0) break;
                k = (size_t)j;
            }
        }
        for (size_t i = 0; i < n; i++)
            if (in[i] == 1) {
                kill(pid[i], SIGKILL);
                found = 1;
            }
        if (!found) break;
        usleep(round < 10 ? 200 : 2000);
    }
    free(pid);
    free(ppid);
    free(in);
}

/* One command: a bash (titled so, a child subreaper) that runs it, says how it ended, and
 * stays while the command's orphans live. ``f`` are the request's fields after "R". */
/* A kill ("K") that comes before the command's process exists: the terminal signals the
 * command's bash (SIGUSR1, whose handler the bash has from the terminal's fork, so no window is
 * left without it), which kills the command if it has started and never starts it if not. */
static volatile sig_atomic_t cmd_killed = 0;
static volatile pid_t cmd_pid = 0;
static pid_t terminal_pid = 0;

static void on_kill(int sig) {
    (void)sig;
    if (getpid() == terminal_pid) return;  /* the terminal's own: anyone of the user's may send it */
    cmd_killed = 1;
    if (cmd_pid > 0) kill(cmd_pid, SIGKILL);
}

static void run_command(char **f, int nf, int fds[3]) {
    signal(SIGCHLD, SIG_DFL);
    set_title("bash");
    prctl(PR_SET_NAME, "bash", 0, 0, 0);
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    int argc = nf > 7 ? atoi(f[7]) : -1;
    int envc = argc >= 1 && 8 + argc < nf ? atoi(f[8 + argc]) : -1;
    if (argc < 1 || envc < 0 || 9 + argc + envc > nf) {
        say(spec.ctl, "E bad request\n", 14);
        _exit(1);
    }
    sigset_t usr1, old;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    sigprocmask(SIG_BLOCK, &usr1, &old);
    pid_t c = cmd_killed ? -2 : fork();
    if (c == 0) {
        signal(SIGUSR1, SIG_DFL);
        sigprocmask(SIG_SETMASK, &old, NULL);
        dup2(fds[0], 0);
        dup2(fds[1], 1);
        dup2(fds[2], 2);
        syscall(SYS_close_range, 3, ~0U, 0);
        static const int res[6] = {RLIMIT_CPU, RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE};
        struct rlimit cur;
        for (int i = 0; i < 6; i++) {
            if (i == 1) continue;
            getrlimit(res[i], &cur);
            rlim_t want = (rlim_t)strtoull(f[i], NULL, 10);
            rlim_t hard = i == 0 ? (rlim_t)strtoull(f[1], NULL, 10) : want;
            if (cur.rlim_max != RLIM_INFINITY && hard > cur.rlim_max) hard = cur.rlim_max;
            if (want > hard) want = hard;
            struct rlimit r = {want, hard};
            setrlimit(res[i], &r);
        }
        struct rlimit core = {0, 0};
        setrlimit(RLIMIT_CORE, &core);
        char **argv = calloc((size_t)argc + 1, sizeof(char *)), **env = calloc((size_t)envc + 1, sizeof(char *));
        if (!argv || !env) _exit(126);
        for (int i = 0; i < argc; i++) argv[i] = f[8 + i];
        for (int i = 0; i < envc; i++) env[i] = f[9 + argc + i];
        if (chdir(f[6]) != 0) {
            fprintf(stderr, "bash: line 1: cd: %s: %s\n", f[6], strerror(errno));
            _exit(1);
        }
        environ = env;
        execvp(argv[0], argv);
        int e = errno;
        fprintf(stderr, "%s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    for (int i = 0; i < 3; i++) close(fds[i]);
    if (c == -1) {
        say(spec.ctl, "E fork\n", 7);
        _exit(1);
    }
    cmd_pid = c;
    sigprocmask(SIG_SETMASK, &old, NULL);  /* a kill that came meanwhile ends the command now */
    int st = SIGKILL;  /* killed before it started: as if by SIGKILL */
    struct rusage ru;
    memset(&ru, 0, sizeof ru);
    while (c > 0 && wait4(c, &st, 0, &ru) < 0 && errno == EINTR) {}
    int left = 0;  /* whether the command left processes running */
    for (;;) {
        pid_t w = waitpid(-1, NULL, WNOHANG);
        if (w > 0) continue;
        left = w == 0;
        break;
    }
    char msg[128];
    int n = snprintf(msg, sizeof msg, "D %d %lld %lld %d\n", st,
                     (long long)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec,
                     (long long)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec, left);
    say(spec.ctl, msg, (size_t)n);
    close(spec.ctl);
    while (wait(NULL) > 0 || errno == EINTR) {}  /* the command's orphans, until none is left */
    _exit(0);
}

static int run_terminal(void) {
    /* root until the first command's pid is set, then the user; serves the host's requests */
    set_next_pid(spec.cmd_pid);
    become(spec.uid, spec.gid, spec.groups);
    if (spec.ctl != 3) {
        if (dup2(spec.ctl, 3) < 0) die("dup2");
        spec.ctl = 3;
    }
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
        dup2(null, 0);
        dup2(null, 1);
        dup2(null, 2);
    }
    syscall(SYS_close_range, 4, ~0U, 0);
    signal(SIGCHLD, SIG_IGN);  /* each command's bash is reaped by the kernel */
    terminal_pid = getpid();
    signal(SIGUSR1, on_kill);  /* inherited by each command's bash (``on_kill``) */
    say(spec.ctl, "R\n", 2);
    pid_t current = 0;
    for (;;) {
        uint32_t len = 0;
        int fds[3] = {-1, -1, -1};
        char cbuf[CMSG_SPACE(3 * sizeof(int))];
        struct iovec iov = {&len, sizeof len};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = cbuf;
        m.msg_controllen = sizeof cbuf;
        ssize_t r = recvmsg(spec.ctl, &m, MSG_CMSG_CLOEXEC);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return 0;  /* the host closed the socket: the episode is over */
        int nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                memcpy(fds, CMSG_DATA(c), (nfds > 3 ? 3 : nfds) * sizeof(int));
            }
        if (r < (ssize_t)sizeof len && read_full(spec.ctl, (char *)&len + r, sizeof len - (size_t)r) != 0) return 0;
        if (len > (64u << 20)) return 1;
        char *buf = malloc((size_t)len + 1);
        if (!buf || read_full(spec.ctl, buf, len) != 0) return 0;
        buf[len] = 0;
        size_t nul = 1;  /* the fields: as many as the request's NULs (and one unterminated) */
        for (uint32_t i = 0; i < len; i++) nul += buf[i] == 0;
        char **f = calloc(nul, sizeof(char *));
        int nf = 0;
        for (char *p = buf; f && p < buf + len; p += strlen(p) + 1) f[nf++] = p;
        if (nf >= 1 && strcmp(f[0], "K") == 0) {
            if (current > 0) {
                kill(current, SIGUSR1);
                kill_tree(current);
            }
        } else if (nf >= 1 && strcmp(f[0], "R") == 0 && nfds == 3) {
            pid_t p = fork();
            if (p == 0) run_command(f + 1, nf - 1, fds);
            current = p;
        } else {
            say(spec.ctl, "E bad request\n", 14);
        }
        for (int i = 0; i < 3; i++)
            if (fds[i] >= 0) close(fds[i]);
        free(f);
        free(buf);
    }
}

static int run_manager(void) {
    /* the user's manager: starts the session as root (each drops to the user itself), then
     * drops too, adopts the session's orphans, and lives as long as the terminal */
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    spawn_sleepers(spec.session);
    int child;
    pid_t term = fork_line(spec.terminal, 0, &child);
    if (child) _exit(run_terminal());
    quiet_fds();
    become(spec.uid, spec.gid, spec.groups);
    return reap_until(term);
}

int main(int argc, char **argv) {
    const char *role = getenv("LAPTOP_INIT_ROLE");
    if (role && strcmp(role, "init") == 0 && getpid() == 1) {
        char **last = environ;
        while (*last) last++;
        title_start = argv[0];
        args_end = argv[argc - 1] + strlen(argv[argc - 1]) + 1;
        title_end = last > environ ? last[-1] + strlen(last[-1]) + 1 : args_end;
        read_spec();
        const char *dev = getenv("LAPTOP_INIT_DEV");
        if (dev) make_dev(dev);
        set_title("/sbin/init");
        prctl(PR_SET_NAME, "systemd", 0, 0, 0);
        spawn_sleepers(spec.services);
        int child;
        pid_t manager = fork_line(spec.manager, 0, &child);
        if (child) _exit(run_manager());
        close(spec.ctl);
        reap_until(manager);
        return 0;
    }
    /* started by hand, as a user would start systemd */
    if (argv[1] && strcmp(argv[1], "--version") == 0) {
        puts("systemd 252 (252.33-1~deb12u1)\n+PAM +AUDIT +SELINUX +APPARMOR +IMA +SMACK +SECCOMP +GCRYPT -GNUTLS "
             "+OPENSSL +ACL +BLKID +CURL +ELFUTILS +FIDO2 +IDN2 -IDN +IPTC +KMOD +LIBCRYPTSETUP +LIBFDISK +PCRE2 "
             "-PWQUALITY +P11KIT +QRENCODE +TPM2 +BZIP2 +LZ4 +XZ +ZLIB +ZSTD -BPF_FRAMEWORK -XKBCOMMON +UTMP "
             "+SYSVINIT default-hierarchy=unified");
        return 0;
    }
    fputs("Failed to allocate manager object: Permission denied\n", stderr);
    return 1;
}
