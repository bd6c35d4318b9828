/* The pod sandbox process: sleep until SIGINT/SIGTERM, reaping orphans (it is pid 1 of the
 * pod's shared namespaces). Built static, so the image is this one file. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void down(int signo) { (void)signo; _exit(0); }
static void reap(int signo) {
  (void)signo;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction d = {.sa_handler = down};
  sigaction(SIGINT, &d, NULL);
  sigaction(SIGTERM, &d, NULL);
  struct sigaction r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGCHLD, &r, NULL);
  for (;;) pause();
  return 42;
}
