/*
 * The local cluster's Pod sandbox process (containerd's sandbox_image): it holds the sandbox's
 * namespaces and does nothing else. No registry is reachable here, so it is built from this file
 * (gcc -static) by scripts/local-cluster.sh and imported into containerd.
 *
 * As PID 1 of a Pod that shares its process namespace it reaps orphans; it exits on SIGTERM or
 * SIGINT (containerd's StopPodSandbox).
 */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction sa = {0};
    sa.sa_handler = stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = reap;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;) {
        pause();
    }
}
