/* labkit-jail: start one program behind the kernel's boundaries (Linux).
 *
 *   labkit-jail [--ro PATH]... [--work-mb N] [--keep-fd N]... [--proc] -- PROGRAM ARGS...
 *
 * The steps, in order:
 *  1. Open every --ro PATH now, as the caller (who may traverse folders the sandbox user
 *     cannot, such as a private home holding the interpreter).
 *  2. Fork; the child unshares user, mount, pid, network, IPC, UTS and cgroup namespaces;
 *     the parent writes its maps: inside uid and gid 65534, outside 65534 for a root caller
 *     (no one's files) and the caller's own ids otherwise. The child drops to 65534 and every
 *     supplementary group (where the kernel lets it: an unprivileged caller's map forbids
 *     setgroups), then forks again: that grandchild is pid 1 of the new pid namespace, a
 *     small init that builds the jail, starts the program as its own child (pid 2: an
 *     init ignores the signals it has no handler for, a program must not) and hands the
 *     program's wait status back to the caller's process, which ends the same way (the
 *     same exit code, or killed by the same signal).
 *  3. Pid 1 builds a new root on a small tmpfs: each --ro path bound read-only at its own
 *     path (a symbolic link recreated as one), /dev with null, zero, random and urandom,
 *     /proc of the new pid namespace where the kernel allows it (--proc), and /work, a tmpfs
 *     of --work-mb MiB for the program's files; pivots into it, detaches the old root and
 *     makes the new root read-only.
 *  4. The program's process sets RLIMIT_NPROC to 0 (no process or thread more for the
 *     sandbox's uid, which the kernel enforces for every uid without capabilities), closes
 *     every file descriptor but 0, 1, 2 and each --keep-fd, sets no_new_privs,
 *     drops every capability (bounding, ambient, effective, permitted, inheritable), installs
 *     a seccomp filter (below) and executes PROGRAM in /work.
 *
 * The seccomp filter refuses (EPERM) the system calls a test program has no use for and that
 * widen an attack: new processes (fork, vfork, clone without CLONE_THREAD; clone3 answers
 * ENOSYS so the C library falls back to clone), ptrace and cross-process memory access,
 * mount and namespace calls, kernel modules and keyrings, bpf, perf events, io_uring,
 * userfaultfd, handle-based opens, device nodes, new sockets (a connected socketpair
 * stays), clocks, swap, reboot. A system
 * call of another architecture (x32 on x86-64) kills the process.
 *
 * Exit status: PROGRAM's, or 128 + its signal; 125 when the jail itself cannot be set up,
 * with one line on stderr naming the step that failed (the caller then knows the machine
 * lacks the mechanism).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <grp.h>
#include <limits.h>

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif

#define SANDBOX_ID 65534
#define NEW_ROOT "/tmp"
#define MAX_RO 64
#define MAX_KEEP 16
#define SETUP_FAILED 125

static const char *ro_paths[MAX_RO];
static int ro_fds[MAX_RO];
static int n_ro = 0;
static int keep_fds[MAX_KEEP];
static int n_keep = 0;
static long work_mb = 64;
static int want_proc = 0;

static void die(const char *step) {
    fprintf(stderr, "labkit-jail: %s: %s\n", step, strerror(errno));
    _exit(SETUP_FAILED);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die(path);
    ssize_t n = write(fd, text, strlen(text));
    if (n != (ssize_t)strlen(text)) die(path);
    close(fd);
}

/* mkdir -p of `path` (absolute) */
static void make_dirs(const char *path) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = 0;
            if (mkdir(buf, 0755) < 0 && errno != EEXIST) die("mkdir");
            *p = '/';
        }
    }
    if (mkdir(buf, 0755) < 0 && errno != EEXIST) die("mkdir");
}

static void parent_dirs(const char *path) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    char *slash = strrchr(buf, '/');
    if (slash && slash != buf) {
        *slash = 0;
        make_dirs(buf);
    }
}

/* the flags a remount in a user namespace must keep (the kernel locks the ones it got) */
static unsigned long kept_flags(const char *path) {
    struct statvfs vfs;
    unsigned long flags = 0;
    if (statvfs(path, &vfs) < 0) return 0;
    if (vfs.f_flag & ST_NOEXEC) flags |= MS_NOEXEC;
    if (vfs.f_flag & ST_NOATIME) flags |= MS_NOATIME;
    if (vfs.f_flag & ST_NODIRATIME) flags |= MS_NODIRATIME;
    if (vfs.f_flag & ST_RELATIME) flags |= MS_RELATIME;
    return flags;
}

/* `path` (its detached tree `fd`, or -2: by path) read-only at NEW_ROOT + `path` */
static void bind_ro(int fd, const char *path) {
    char target[PATH_MAX];
    struct stat st;
    snprintf(target, sizeof target, "%s%s", NEW_ROOT, path);
    if ((fd >= 0 ? fstat(fd, &st) : stat(path, &st)) < 0) die(path);
    if (S_ISDIR(st.st_mode)) {
        make_dirs(target);
    } else {
        parent_dirs(target);
        int made = open(target, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (made < 0) die("create a mount point");
        close(made);
    }
    if (fd >= 0) {
        if (syscall(SYS_move_mount, fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            die("attach a cloned tree");
    } else if (mount(path, target, NULL, MS_BIND | MS_REC, NULL) < 0) {
        die("bind mount");
    }
    if (mount(NULL, target, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV |
              kept_flags(target), NULL) < 0)
        die("remount read-only");
}

static void add_ro(const char *path) {
    char target[PATH_MAX], link[PATH_MAX];
    struct stat st;
    if (n_ro >= MAX_RO) { errno = E2BIG; die("--ro"); }
    if (lstat(path, &st) < 0) die(path);
    ro_paths[n_ro] = path;
    if (S_ISLNK(st.st_mode)) {  /* recreated as a link inside; its target needs its own --ro */
        ro_fds[n_ro++] = -1;
        (void)target; (void)link;
        return;
    }
    /* a root caller's paths are cloned as detached mount trees now, while it may traverse
       folders the sandbox user cannot; an unprivileged caller binds them by path later
       (its own ids are the sandbox's, so it sees what it sees now) */
    int fd = geteuid() == 0
        ? (int)syscall(SYS_open_tree, AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE)
        : -2;
    if (fd == -1) die(path);
    ro_fds[n_ro++] = fd;
}

static void make_link(const char *path) {
    char target[PATH_MAX], dest[PATH_MAX];
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0) die("readlink");
    target[n] = 0;
    snprintf(dest, sizeof dest, "%s%s", NEW_ROOT, path);
    parent_dirs(dest);
    if (symlink(target, dest) < 0 && errno != EEXIST) die("symlink");
}

static void bind_device(const char *name) {
    char source[64], target[PATH_MAX];
    snprintf(source, sizeof source, "/dev/%s", name);
    snprintf(target, sizeof target, "%s/dev/%s", NEW_ROOT, name);
    int made = open(target, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (made < 0) die("create a device mount point");
    close(made);
    if (mount(source, target, NULL, MS_BIND, NULL) < 0) die("bind a device");
    mount(NULL, target, NULL, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC | kept_flags(target),
          NULL);
}

static void build_root(void) {
    char path[PATH_MAX];
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make / private");
    if (mount("labkit-root", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755") < 0)
        die("mount the new root");
    for (int i = 0; i < n_ro; i++) {
        if (ro_fds[i] == -1) make_link(ro_paths[i]);
        else bind_ro(ro_fds[i], ro_paths[i]);
    }
    snprintf(path, sizeof path, "%s/dev", NEW_ROOT);
    make_dirs(path);
    const char *devices[] = {"null", "zero", "random", "urandom"};
    for (size_t i = 0; i < sizeof devices / sizeof *devices; i++) bind_device(devices[i]);
    snprintf(path, sizeof path, "%s/work", NEW_ROOT);
    make_dirs(path);
    char options[64];
    snprintf(options, sizeof options, "size=%ldm,mode=0700,nr_inodes=4096", work_mb);
    if (mount("labkit-work", path, "tmpfs", MS_NOSUID | MS_NODEV, options) < 0) die("mount /work");
    if (want_proc) {
        snprintf(path, sizeof path, "%s/proc", NEW_ROOT);
        make_dirs(path);
        if (mount("proc", path, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2") < 0 &&
            mount("proc", path, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            die("mount /proc");
    }
    if (chdir(NEW_ROOT) < 0) die("chdir to the new root");
    if (syscall(SYS_pivot_root, ".", ".") < 0) die("pivot_root");
    if (umount2(".", MNT_DETACH) < 0) die("detach the old root");
    if (chdir("/") < 0) die("chdir /");
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) < 0)
        die("make the new root read-only");
    if (chdir("/work") < 0) die("chdir /work");
}

static void close_fds(void) {
    for (int fd = 3; fd < 1024; fd++) {
        int keep = 0;
        for (int i = 0; i < n_keep; i++) keep |= keep_fds[i] == fd;
        if (!keep) close(fd);
    }
}

static void drop_capabilities(void) {
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs");
    for (int cap = 0; cap <= 63; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) die("drop the bounding set");
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) < 0) die("capset");
}

/* ---------------------------------------------------------------------- seccomp */

#if defined(__x86_64__)
#define ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH AUDIT_ARCH_AARCH64
#else
#error "labkit-jail knows the system calls of x86-64 and aarch64 only"
#endif

#define LOAD_NR BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr))
#define DENY(nr, err) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), \
                      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ((err) & SECCOMP_RET_DATA))
#define REFUSE(nr) DENY(nr, EPERM)

static void install_filter(void) {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        LOAD_NR,
#if defined(__x86_64__)
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1),  /* x32 */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        REFUSE(__NR_fork), REFUSE(__NR_vfork), REFUSE(__NR_iopl), REFUSE(__NR_ioperm),
        REFUSE(__NR_mknod), REFUSE(__NR_uselib), REFUSE(__NR_create_module),
#endif
        DENY(__NR_clone3, ENOSYS),
        REFUSE(__NR_ptrace), REFUSE(__NR_process_vm_readv), REFUSE(__NR_process_vm_writev),
        REFUSE(__NR_kcmp), REFUSE(__NR_pidfd_getfd), REFUSE(__NR_pidfd_open),
        REFUSE(__NR_pidfd_send_signal),
        REFUSE(__NR_mount), REFUSE(__NR_umount2), REFUSE(__NR_pivot_root), REFUSE(__NR_chroot),
        REFUSE(__NR_unshare), REFUSE(__NR_setns), REFUSE(__NR_open_tree), REFUSE(__NR_move_mount),
        REFUSE(__NR_fsopen), REFUSE(__NR_fsconfig), REFUSE(__NR_fsmount), REFUSE(__NR_fspick),
        REFUSE(__NR_mount_setattr),
        REFUSE(__NR_bpf), REFUSE(__NR_perf_event_open), REFUSE(__NR_userfaultfd),
        REFUSE(__NR_keyctl), REFUSE(__NR_add_key), REFUSE(__NR_request_key),
        REFUSE(__NR_init_module), REFUSE(__NR_finit_module), REFUSE(__NR_delete_module),
        REFUSE(__NR_kexec_load), REFUSE(__NR_kexec_file_load), REFUSE(__NR_reboot),
        REFUSE(__NR_swapon), REFUSE(__NR_swapoff), REFUSE(__NR_acct), REFUSE(__NR_quotactl),
        REFUSE(__NR_syslog), REFUSE(__NR_lookup_dcookie), REFUSE(__NR_fanotify_init),
        REFUSE(__NR_open_by_handle_at), REFUSE(__NR_name_to_handle_at),
        REFUSE(__NR_io_uring_setup), REFUSE(__NR_io_uring_enter), REFUSE(__NR_io_uring_register),
        REFUSE(__NR_mknodat), REFUSE(__NR_settimeofday), REFUSE(__NR_clock_settime),
        REFUSE(__NR_clock_adjtime), REFUSE(__NR_adjtimex),
        REFUSE(__NR_mbind), REFUSE(__NR_migrate_pages), REFUSE(__NR_move_pages),
        REFUSE(__NR_socket),  /* socketpair stays: an event loop wakes itself through one */
        /* clone: threads only (CLONE_THREAD in the flags, the first argument) */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_THREAD, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog program = {(unsigned short)(sizeof filter / sizeof *filter), filter};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) < 0) die("install the seccomp filter");
}

/* ------------------------------------------------------------------------- main */

static int status_of(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return SETUP_FAILED;
}

static int wait_for(pid_t pid) {
    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) return SETUP_FAILED;
    }
    return status_of(status);
}

/* end this process as the program ended: its exit code, or its signal */
static int end_like(int status) {
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        sigset_t all;
        signal(sig, SIG_DFL);
        sigfillset(&all);
        sigprocmask(SIG_UNBLOCK, &all, NULL);
        prctl(PR_SET_DUMPABLE, 0);
        kill(getpid(), sig);
        return 128 + sig;  /* a signal whose default is not to end the process */
    }
    return status_of(status);
}

int main(int argc, char **argv) {
    int i = 1;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (!strcmp(argv[i], "--ro") && i + 1 < argc) add_ro(argv[++i]);
        else if (!strcmp(argv[i], "--work-mb") && i + 1 < argc) work_mb = atol(argv[++i]);
        else if (!strcmp(argv[i], "--keep-fd") && i + 1 < argc && n_keep < MAX_KEEP)
            keep_fds[n_keep++] = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--proc")) want_proc = 1;
        else {
            fprintf(stderr, "labkit-jail: unknown argument %s\n", argv[i]);
            return SETUP_FAILED;
        }
    }
    if (i + 1 >= argc || work_mb < 1) {
        fprintf(stderr, "usage: labkit-jail [--ro PATH]... [--work-mb N] [--keep-fd N]... "
                        "[--proc] -- PROGRAM ARGS...\n");
        return SETUP_FAILED;
    }
    char **program = argv + i + 1;
    uid_t outer_uid = geteuid();
    gid_t outer_gid = getegid();
    int root = outer_uid == 0;
    pid_t caller = getpid();
    int ready[2], mapped[2], ended[2];
    if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(mapped, O_CLOEXEC) < 0 || pipe2(ended, O_CLOEXEC) < 0)
        die("pipe");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child > 0) {  /* the caller's process: write the child's maps, then wait */
        char byte;
        close(ready[1]);
        close(mapped[0]);
        close(ended[1]);
        if (read(ready[0], &byte, 1) != 1) return wait_for(child);
        char path[64], map[64];
        snprintf(map, sizeof map, "%d %d 1\n", SANDBOX_ID, root ? SANDBOX_ID : (int)outer_uid);
        snprintf(path, sizeof path, "/proc/%d/uid_map", (int)child);
        write_file(path, map);
        if (!root) {
            snprintf(path, sizeof path, "/proc/%d/setgroups", (int)child);
            write_file(path, "deny");
        }
        snprintf(map, sizeof map, "%d %d 1\n", SANDBOX_ID, root ? SANDBOX_ID : (int)outer_gid);
        snprintf(path, sizeof path, "/proc/%d/gid_map", (int)child);
        write_file(path, map);
        if (write(mapped[1], "1", 1) != 1) die("signal the child");
        int status, code = wait_for(child);
        if (read(ended[0], &status, sizeof status) == (ssize_t)sizeof status) return end_like(status);
        return code;  /* the jail failed before the program started (125) */
    }
    /* the child: new namespaces, then its ids inside them */
    close(ready[0]);
    close(mapped[1]);
    close(ended[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC |
                CLONE_NEWUTS | CLONE_NEWCGROUP) < 0)
        die("unshare the namespaces");
    char byte;
    if (write(ready[1], "1", 1) != 1 || read(mapped[0], &byte, 1) != 1) die("wait for the maps");
    if (root && setgroups(0, NULL) < 0) die("drop the supplementary groups");
    if (setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID) < 0) die("setresgid");
    prctl(PR_SET_KEEPCAPS, 1);
    if (setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID) < 0) die("setresuid");
    prctl(PR_SET_PDEATHSIG, SIGKILL);  /* a change of ids clears it: set it again */
    if (getppid() != caller) _exit(SETUP_FAILED);  /* the caller's process died meanwhile */
    pid_t init = fork();
    if (init < 0) die("fork pid 1");
    if (init > 0) return wait_for(init);
    /* pid 1 of the new pid namespace: build the jail, start the program, pass on its end */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (sethostname("sandbox", 7) < 0) die("sethostname");
    build_root();
    pid_t program_pid = fork();
    if (program_pid < 0) die("fork the program");
    if (program_pid == 0) {
        struct rlimit none = {0, 0};  /* no new process or thread for the sandbox's uid */
        if (setrlimit(RLIMIT_NPROC, &none) < 0) die("RLIMIT_NPROC");
        close_fds();
        drop_capabilities();
        install_filter();
        execv(program[0], program);
        die("execute the program");
    }
    for (int fd = 3; fd < 1024; fd++) if (fd != ended[1]) close(fd);
    int status;
    for (;;) {  /* reap every child; stop at the program's end */
        pid_t done = waitpid(-1, &status, 0);
        if (done == program_pid) break;
        if (done < 0 && errno != EINTR) _exit(SETUP_FAILED);
    }
    if (write(ended[1], &status, sizeof status) != (ssize_t)sizeof status) _exit(SETUP_FAILED);
    _exit(0);
}
