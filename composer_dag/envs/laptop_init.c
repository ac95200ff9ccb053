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
 *             the command                  (as the user, with the caller's environment)
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
 *   LAPTOP_INIT_CMD_PID             the pid the command should get
 *   LAPTOP_INIT_ARGC, LAPTOP_INIT_ARG0..   the command's argv
 *   LAPTOP_INIT_PATH                the command's PATH (process 1's own is /usr/lib/systemd)
 *   LAPTOP_INIT_DEV                 the laptop's /dev entries to make (see make_dev)
 * A pid is a hint: the next pid is set through /proc/sys/kernel/ns_last_pid where the kernel
 * allows it, so the tree's numbers look like those of a machine that has been up a while.
 *
 * Exit status: the command's, or 128 + the signal that killed it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/wait.h>
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
static char *title_start, *title_end;

static void set_title(const char *title) {
    size_t n = strlen(title), room = (size_t)(title_end - title_start);
    if (n >= room) n = room - 1;
    memcpy(title_start, title, n);
    memset(title_start + n, 0, room - n);
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
    char **argv;      /* the command */
    char **env;       /* the command's environment */
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
    int argc = atoi(need("LAPTOP_INIT_ARGC"));
    if (argc < 1 || argc > 100000) {
        fprintf(stderr, "systemd: bad LAPTOP_INIT_ARGC\n");
        _exit(126);
    }
    spec.argv = calloc(argc + 1, sizeof(char *));
    for (int i = 0; i < argc; i++) {
        char key[32];
        snprintf(key, sizeof key, "LAPTOP_INIT_ARG%d", i);
        spec.argv[i] = strdup(need(key));
    }
    size_t n = 0;
    for (char **e = environ; *e; e++) n++;
    spec.env = calloc(n + 2, sizeof(char *));
    size_t k = 0;
    for (char **e = environ; *e; e++) {
        if (strncmp(*e, "LAPTOP_INIT_PATH=", 17) == 0) {
            if (asprintf(&spec.env[k++], "PATH=%s", *e + 17) < 0) die("asprintf");
        } else if (strncmp(*e, "LAPTOP_INIT_", 12) != 0 && strncmp(*e, "PATH=", 5) != 0) {
            spec.env[k++] = strdup(*e);
        }
    }
    if (!spec.argv[0] || !spec.env) die("calloc");
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

static int run_terminal(void) {
    /* root until the command's pid is set, then the user, then the command */
    set_next_pid(spec.cmd_pid);
    become(spec.uid, spec.gid, spec.groups);
    syscall(SYS_close_range, 3, ~0U, 0);
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        environ = spec.env;
        execvp(spec.argv[0], spec.argv);
        int e = errno;
        fprintf(stderr, "%s: %s\n", spec.argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    return reap_until(pid);
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
    (void)argc;
    const char *role = getenv("LAPTOP_INIT_ROLE");
    if (role && strcmp(role, "init") == 0 && getpid() == 1) {
        char **last = environ;
        while (*last) last++;
        title_start = argv[0];
        title_end = last > environ ? last[-1] + strlen(last[-1]) + 1 : argv[0] + strlen(argv[0]) + 1;
        read_spec();
        const char *dev = getenv("LAPTOP_INIT_DEV");
        if (dev) make_dev(dev);
        set_title("/sbin/init");
        prctl(PR_SET_NAME, "systemd", 0, 0, 0);
        spawn_sleepers(spec.services);
        int child;
        pid_t manager = fork_line(spec.manager, 0, &child);
        if (child) _exit(run_manager());
        return reap_until(manager);
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
