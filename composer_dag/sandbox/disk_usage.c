/* What the sandbox's disk cap counts in its writable host trees, measured after every command.
 *
 *   disk_usage MAX_DEPTH ROOT...
 *
 * prints "<bytes> <entries>\n" and then, each followed by a NUL, the directories nested deeper
 * than MAX_DEPTH levels under a root or with a path over 2,048 characters (counted, not walked
 * into). Bytes: per entry the larger of its allocated size and, for a regular file, its
 * apparent size; links are not followed; the roots themselves are not counted. An entry that
 * vanishes while it is walked is counted without its size. Exit status 0, or 2 on bad usage.
 */
#define _GNU_SOURCE
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static unsigned long long bytes, entries;
static int max_depth;
static char **deep;
static size_t ndeep, capdeep;

static int visit(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    if (ftw->level == 0) return FTW_CONTINUE;
    entries++;
    if (flag != FTW_NS) {
        unsigned long long alloc = (unsigned long long)st->st_blocks * 512;
        unsigned long long apparent = S_ISREG(st->st_mode) ? (unsigned long long)st->st_size : 0;
        bytes += alloc > apparent ? alloc : apparent;
    }
    if ((flag == FTW_D || flag == FTW_DNR) && (ftw->level > max_depth || strlen(path) > 2048)) {
        if (ndeep == capdeep) {
            capdeep = capdeep ? 2 * capdeep : 16;
            deep = realloc(deep, capdeep * sizeof *deep);
            if (!deep) return FTW_STOP;
        }
        deep[ndeep++] = strdup(path);
        return FTW_SKIP_SUBTREE;
    }
    return FTW_CONTINUE;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fputs("usage: disk_usage MAX_DEPTH ROOT...\n", stderr);
        return 2;
    }
    max_depth = atoi(argv[1]);
    for (int i = 2; i < argc; i++) nftw(argv[i], visit, 64, FTW_PHYS | FTW_ACTIONRETVAL);
    printf("%llu %llu\n", bytes, entries);
    for (size_t i = 0; i < ndeep; i++) fwrite(deep[i], 1, strlen(deep[i]) + 1, stdout);
    return 0;
}
