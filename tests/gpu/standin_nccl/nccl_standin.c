/* A stand-in libnccl.so.2 for CPU tests: NCCL's C API over host memory, between processes through files.
 *
 * Loaded by horovod through HOROVOD_NCCL_SO_PATH, together with a device backend whose "device memory" is host
 * memory (tests/conformance/emulated_device.py, NcclHostBackend), it drives the engine's NCCL path on a CPU:
 *  - every call is recorded, one line each, in $STANDIN_NCCL_DIR/calls.<HOROVOD_RANK or pid>.log
 *    ("<comm> <seq> <call> key=value..."), so a test can compare the call sequences of the ranks per communicator;
 *  - in the default mode ("exchange") each collective really runs: every rank writes what it contributes to a file
 *    named by the communicator and the call's sequence number, reads its peers' files and computes its result
 *    (in the call: the emulated streams are synchronous).  STANDIN_NCCL_MODE=record only records;
 *  - failures on demand (STANDIN_NCCL_FAIL): "call:N" the Nth collective call returns ncclSystemError,
 *    "async:N" after the Nth call ncclCommGetAsyncError reports ncclRemoteError (and the call's work never
 *    completes, as a kernel whose peer vanished does not), "hang:N" the Nth call never
 *    completes (it returns, but the emulated GPU stays busy: standinBusy() is 1 until the communicator is aborted),
 *    "init_hang" this process never joins a communicator;
 *  - a collective whose peers do not all arrive within STANDIN_NCCL_WAIT seconds (default 60) never completes
 *    either, as a kernel waiting for a dead peer would not;
 *  - STANDIN_NCCL_VERSION (default 23007) is what ncclGetVersion reports; the environment's
 *    NCCL_LAUNCH_ORDER_IMPLICIT is recorded at each communicator's creation.
 * Written for the tests (tests/gpu/standin.py compiles it with the system's cc); not a model of NCCL's speed. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct {
  size_t size; unsigned int magic; unsigned int version;
  int blocking; int cgaClusterSize; int minCTAs; int maxCTAs; const char *netName;
} ncclConfig_t;

enum { OK = 0, SYSERR = 2, INVALID = 4, USAGE = 5, REMOTE = 6, INPROGRESS = 7 };

typedef struct Comm {
  char tag[17];
  int rank, size, blocking, init_pending, connect_pending;
  long seq;
  long *p2p_sent, *p2p_recv;      /* per peer: messages sent / received */
  int async_error, hung, dead;
} Comm;

enum Kind { ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCESCATTER, SEND, RECV };
static const char *KIND_NAMES[] = {"ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
                                   "ncclReduceScatter", "ncclSend", "ncclRecv"};
typedef struct Op {
  enum Kind kind; const void *send; void *recv; size_t count; int dtype, redop, root; Comm *comm; long seq;
} Op;

static FILE *g_log;
static long g_calls;
static int g_group_depth, g_busy;
static Op *g_group; static int g_group_len, g_group_cap;
static char g_last_error[512];

static const char *dir_(void) { const char *d = getenv("STANDIN_NCCL_DIR"); return d && *d ? d : "/tmp"; }
static int record_only(void) { const char *m = getenv("STANDIN_NCCL_MODE"); return m && !strcmp(m, "record"); }
static double wait_limit(void) { const char *w = getenv("STANDIN_NCCL_WAIT"); return w ? atof(w) : 60.0; }

static long fail_at(const char *what) {
  const char *f = getenv("STANDIN_NCCL_FAIL");
  size_t n = strlen(what);
  if (!f || strncmp(f, what, n) || f[n] != ':') return -1;
  return atol(f + n + 1);
}

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char *fmt, ...) {
  if (!g_log) {
    char path[4096]; const char *r = getenv("HOROVOD_RANK");
    snprintf(path, sizeof path, "%s/calls.%s.log", dir_(), r && *r ? r : "pid");
    if (!(r && *r)) snprintf(path, sizeof path, "%s/calls.%d.log", dir_(), (int)getpid());
    g_log = fopen(path, "a");
    if (!g_log) return;
    setvbuf(g_log, NULL, _IOLBF, 0);
  }
  va_list ap; va_start(ap, fmt); vfprintf(g_log, fmt, ap); va_end(ap);
}

static double now_(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void nap_(void) { struct timespec t = {0, 200000}; nanosleep(&t, NULL); }

/* -- the exchange: one file per (communicator, call, rank) ------------------------------------------------------ */
static void path_(char *out, size_t n, const Comm *c, const char *what, long seq, int rank) {
  snprintf(out, n, "%s/x.%s.%s.%ld.%d", dir_(), c->tag, what, seq, rank);
}

static int post_(const Comm *c, const char *what, long seq, const void *data, size_t nbytes) {
  char path[4096], tmp[4200];
  path_(path, sizeof path, c, what, seq, c->rank);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "wb");
  if (!f) { snprintf(g_last_error, sizeof g_last_error, "stand-in: cannot write %s: %s", tmp, strerror(errno)); return SYSERR; }
  if (nbytes && fwrite(data, 1, nbytes, f) != nbytes) { fclose(f); return SYSERR; }
  fclose(f);
  return rename(tmp, path) ? SYSERR : OK;
}

/* Read rank's contribution into out (nbytes); 1 when read, 0 when it never came (the communicator then hangs). */
static int fetch_(Comm *c, const char *what, long seq, int rank, void *out, size_t nbytes) {
  char path[4096];
  path_(path, sizeof path, c, what, seq, rank);
  double deadline = now_() + wait_limit();
  FILE *f;
  while (!(f = fopen(path, "rb"))) {
    if (now_() > deadline) {
      logf_("%s %ld hung waiting-for-rank=%d\n", c->tag, seq, rank);
      c->hung = 1; g_busy = 1;
      return 0;
    }
    nap_();
  }
  size_t got = nbytes ? fread(out, 1, nbytes, f) : 0;
  fclose(f);
  if (got != nbytes) {
    snprintf(g_last_error, sizeof g_last_error, "stand-in: rank %d sent %zu bytes for call %ld, expected %zu",
             rank, got, seq, nbytes);
    c->async_error = INVALID;
  }
  return 1;
}

static size_t item_(int dtype) {
  static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  return dtype >= 0 && dtype < 10 ? sizes[dtype] : 0;
}

static float half_to_float(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
  if (e == 0) {
    if (!m) bits = s;
    else { float v = ldexpf((float)m, -24); return s ? -v : v; }
  } else if (e == 31) bits = s | 0x7f800000 | (m << 13);
  else bits = s | ((e + 112) << 23) | (m << 13);
  float f; memcpy(&f, &bits, 4); return f;
}

static uint16_t float_to_half(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  uint16_t s = (x >> 16) & 0x8000;
  float a = fabsf(f);
  if (isnan(f)) return s | 0x7e00;
  if (a >= 65520.0f) return s | 0x7c00;
  if (a < 6.103515625e-05f) return s | (uint16_t)lrintf(a * 16777216.0f);   /* subnormal: units of 2^-24 */
  uint32_t e = ((x >> 23) & 0xff) - 112, m = x & 0x7fffff;
  uint32_t h = (e << 10) | (m >> 13), rest = m & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
  return s | (uint16_t)h;
}

static float bf16_to_float(uint16_t b) { uint32_t x = (uint32_t)b << 16; float f; memcpy(&f, &x, 4); return f; }
static uint16_t float_to_bf16(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  if (isnan(f)) return (x >> 16) | 0x40;
  return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static double get_(const void *p, size_t i, int dtype) {
  switch (dtype) {
    case 0: return ((const int8_t *)p)[i];   case 1: return ((const uint8_t *)p)[i];
    case 2: return ((const int32_t *)p)[i];  case 3: return ((const uint32_t *)p)[i];
    case 4: return (double)((const int64_t *)p)[i]; case 5: return (double)((const uint64_t *)p)[i];
    case 6: return half_to_float(((const uint16_t *)p)[i]); case 7: return ((const float *)p)[i];
    case 8: return ((const double *)p)[i];   default: return bf16_to_float(((const uint16_t *)p)[i]);
  }
}

static void put_(void *p, size_t i, int dtype, double v) {
  switch (dtype) {
    case 0: ((int8_t *)p)[i] = (int8_t)(int64_t)v; break;   case 1: ((uint8_t *)p)[i] = (uint8_t)(int64_t)v; break;
    case 2: ((int32_t *)p)[i] = (int32_t)(int64_t)v; break; case 3: ((uint32_t *)p)[i] = (uint32_t)(int64_t)v; break;
    case 4: ((int64_t *)p)[i] = (int64_t)v; break;          case 5: ((uint64_t *)p)[i] = (uint64_t)v; break;
    case 6: ((uint16_t *)p)[i] = float_to_half((float)v); break; case 7: ((float *)p)[i] = (float)v; break;
    case 8: ((double *)p)[i] = v; break;                    default: ((uint16_t *)p)[i] = float_to_bf16((float)v);
  }
}

/* out[i] = reduce over ranks of blocks[r][offset + i]; 64-bit integers exactly, the rest in double. */
static void reduce_(void *out, void **blocks, int nblocks, size_t offset, size_t count, int dtype, int op) {
  for (size_t i = 0; i < count; i++) {
    if (dtype == 4 || dtype == 5) {
      int64_t acc = ((int64_t *)blocks[0])[offset + i];
      for (int r = 1; r < nblocks; r++) {
        int64_t v = ((int64_t *)blocks[r])[offset + i];
        if (op == 0 || op == 4) acc += v; else if (op == 1) acc *= v;
        else if (op == 2) acc = dtype == 5 ? ((uint64_t)v > (uint64_t)acc ? v : acc) : (v > acc ? v : acc);
        else acc = dtype == 5 ? ((uint64_t)v < (uint64_t)acc ? v : acc) : (v < acc ? v : acc);
      }
      if (op == 4) acc /= nblocks;
      ((int64_t *)out)[i] = acc;
      continue;
    }
    double acc = get_(blocks[0], offset + i, dtype);
    for (int r = 1; r < nblocks; r++) {
      double v = get_(blocks[r], offset + i, dtype);
      if (op == 0 || op == 4) acc += v; else if (op == 1) acc *= v;
      else if (op == 2) acc = v > acc ? v : acc; else acc = v < acc ? v : acc;
    }
    if (op == 4) acc = dtype >= 6 ? acc / nblocks : trunc(acc / nblocks);
    put_(out, i, dtype, acc);
  }
}

static int post_op(Op *o) {
  Comm *c = o->comm; size_t item = item_(o->dtype);
  switch (o->kind) {
    case ALLREDUCE: case REDUCE: return post_(c, "c", o->seq, o->send, o->count * item);
    case REDUCESCATTER: return post_(c, "c", o->seq, o->send, o->count * item * c->size);
    case ALLGATHER: return post_(c, "c", o->seq, o->send, o->count * item);
    case BROADCAST: return c->rank == o->root ? post_(c, "c", o->seq, o->send, o->count * item) : OK;
    case SEND: {
      char what[64]; snprintf(what, sizeof what, "p%dto%d", c->rank, o->root);
      return post_(c, what, c->p2p_sent[o->root]++, o->send, o->count * item);
    }
    default: return OK;
  }
}

static int complete_op(Op *o) {
  Comm *c = o->comm; size_t item = item_(o->dtype), n = o->count * item;
  if (c->hung) return OK;
  if (o->kind == SEND) return OK;
  if (o->kind == RECV) {
    char what[64]; snprintf(what, sizeof what, "p%dto%d", o->root, c->rank);
    fetch_(c, what, c->p2p_recv[o->root]++, o->root, o->recv, n);
    return OK;
  }
  if (o->kind == BROADCAST) {
    if (c->rank == o->root) { if (o->recv != o->send) memmove(o->recv, o->send, n); return OK; }
    fetch_(c, "c", o->seq, o->root, o->recv, n);
    return OK;
  }
  if (o->kind == REDUCE && c->rank != o->root) return OK;
  size_t each = o->kind == REDUCESCATTER ? n * c->size : n;
  void **blocks = calloc(c->size, sizeof(void *));
  int complete = 1;
  for (int r = 0; r < c->size && complete; r++) {
    blocks[r] = malloc(each ? each : 1);
    if (r == c->rank) memcpy(blocks[r], o->send, each);
    else complete = fetch_(c, "c", o->seq, r, blocks[r], each);
  }
  if (complete) {
    if (o->kind == ALLGATHER) for (int r = 0; r < c->size; r++) memcpy((char *)o->recv + r * n, blocks[r], n);
    else reduce_(o->recv, blocks, c->size, o->kind == REDUCESCATTER ? o->count * c->rank : 0, o->count,
                 o->dtype, o->redop);
  }
  for (int r = 0; r < c->size; r++) free(blocks[r]);
  free(blocks);
  return OK;
}

static int run_ops(Op *ops, int n) {
  if (record_only()) return OK;
  for (int i = 0; i < n; i++) if (!ops[i].comm->hung && post_op(&ops[i]) != OK) return SYSERR;
  for (int i = 0; i < n; i++) complete_op(&ops[i]);
  return OK;
}

static int enqueue_(enum Kind kind, const void *send, void *recv, size_t count, int dtype, int redop, int root,
                    void *comm) {
  Comm *c = comm;
  if (!c || c->dead) { snprintf(g_last_error, sizeof g_last_error, "stand-in: communicator freed"); return USAGE; }
  if (!item_(dtype) || (redop < 0 || redop > 4)) { snprintf(g_last_error, sizeof g_last_error,
      "stand-in: invalid dtype %d or op %d", dtype, redop); return INVALID; }
  long call = ++g_calls, seq = (kind == SEND || kind == RECV) ? -1 : c->seq++;
  logf_("%s %ld %s count=%zu dtype=%d op=%d root=%d send=%p recv=%p group=%d call=%ld\n", c->tag, seq,
        KIND_NAMES[kind], count, dtype, redop, root, send, recv, g_group_depth > 0, call);
  if (fail_at("call") == call) {
    snprintf(g_last_error, sizeof g_last_error, "stand-in: call %ld fails on purpose (STANDIN_NCCL_FAIL)", call);
    return SYSERR;
  }
  if (fail_at("async") == call) { c->async_error = REMOTE; c->hung = 1; g_busy = 1; }   /* its kernels stay stuck */
  if (fail_at("hang") == call) { c->hung = 1; g_busy = 1; logf_("%s %ld hung on-purpose\n", c->tag, seq); }
  Op op = {kind, send, recv, count, dtype, redop, root, c, seq};
  if (g_group_depth > 0) {
    if (g_group_len == g_group_cap) {
      g_group_cap = g_group_cap ? 2 * g_group_cap : 16;
      g_group = realloc(g_group, g_group_cap * sizeof(Op));
    }
    g_group[g_group_len++] = op;
    return OK;
  }
  int rc = run_ops(&op, 1);
  if (rc == OK && c->connect_pending) { c->connect_pending = 0; return INPROGRESS; }   /* a lazy connect */
  return rc;
}

/* -- the API ------------------------------------------------------------------------------------------------------ */
int ncclGetVersion(int *version) {
  const char *v = getenv("STANDIN_NCCL_VERSION");
  *version = v ? atoi(v) : 23007;
  return OK;
}

/* Called by ncclGetVersion's users through the library's own binding (see tests: an RTLD_DEEPBIND check). */
__attribute__((noinline)) int standinIdentity(void) { return 1; }
int standinSelfIdentity(void) { return standinIdentity(); }
/* Whether the emulated GPU holds work that never completes (a hung collective of a communicator not yet aborted). */
int standinBusy(void) { return g_busy; }

int ncclGetUniqueId(ncclUniqueId *id) {
  FILE *f = fopen("/dev/urandom", "rb");
  if (!f || fread(id->internal, 1, 128, f) != 128) { if (f) fclose(f); return SYSERR; }
  fclose(f);
  return OK;
}

static int init_(void **out, int nranks, ncclUniqueId id, int rank, int blocking) {
  Comm *c = calloc(1, sizeof(Comm));
  for (int i = 0; i < 8; i++) snprintf(c->tag + 2 * i, 3, "%02x", (unsigned char)id.internal[i]);
  c->rank = rank; c->size = nranks; c->blocking = blocking;
  c->p2p_sent = calloc(nranks, sizeof(long)); c->p2p_recv = calloc(nranks, sizeof(long));
  const char *order = getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
  logf_("%s -1 init rank=%d size=%d blocking=%d launch_order_implicit=%s\n", c->tag, rank, nranks, blocking,
        order ? order : "unset");
  *out = c;
  int frozen = getenv("STANDIN_NCCL_FAIL") && !strcmp(getenv("STANDIN_NCCL_FAIL"), "init_hang");
  if (record_only()) return OK;
  if (!frozen && post_(c, "init", 0, "", 0) != OK) return SYSERR;
  if (!blocking) { c->init_pending = 1; c->connect_pending = 1; return INPROGRESS; }
  if (frozen) for (;;) sleep(1);   /* a blocking init that never returns: what a frozen peer does to NCCL */
  char buf[1];
  for (int r = 0; r < nranks; r++)
    if (r != rank && !fetch_(c, "init", 0, r, buf, 0)) {
      snprintf(g_last_error, sizeof g_last_error, "stand-in: rank %d never joined communicator %s", r, c->tag);
      return SYSERR;
    }
  return OK;
}

int ncclCommInitRank(void **comm, int nranks, ncclUniqueId id, int rank) { return init_(comm, nranks, id, rank, 1); }

int ncclCommInitRankConfig(void **comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *config) {
  int blocking = !config || config->blocking == INT_MIN || config->blocking != 0;
  return init_(comm, nranks, id, rank, blocking);
}

static int joined_(Comm *c) {
  char path[4096];
  if (getenv("STANDIN_NCCL_FAIL") && !strcmp(getenv("STANDIN_NCCL_FAIL"), "init_hang")) return 0;
  for (int r = 0; r < c->size; r++) {
    path_(path, sizeof path, c, "init", 0, r);
    if (access(path, F_OK)) return 0;
  }
  return 1;
}

int ncclCommGetAsyncError(void *comm, int *err) {
  Comm *c = comm;
  if (!c) return INVALID;
  if (c->init_pending) {
    if (record_only() || joined_(c)) c->init_pending = 0;
    *err = c->init_pending ? INPROGRESS : OK;
    return OK;
  }
  *err = c->async_error;
  return OK;
}

static int free_(void *comm, const char *how) {
  Comm *c = comm;
  if (!c) return OK;
  logf_("%s -1 %s\n", c->tag, how);
  if (c->hung) g_busy = 0;
  c->dead = 1;   /* kept (not freed): a test may still ask; a stand-in leaks a few bytes per communicator */
  return OK;
}
int ncclCommFinalize(void *comm) { logf_("%s -1 finalize\n", ((Comm *)comm)->tag); return OK; }
int ncclCommDestroy(void *comm) { return free_(comm, "destroy"); }
int ncclCommAbort(void *comm) { return free_(comm, "abort"); }
int ncclCommCount(const void *comm, int *count) { *count = ((const Comm *)comm)->size; return OK; }
int ncclCommCuDevice(const void *comm, int *device) { (void)comm; *device = 0; return OK; }
int ncclCommUserRank(const void *comm, int *rank) { *rank = ((const Comm *)comm)->rank; return OK; }

const char *ncclGetErrorString(int result) {
  static const char *names[] = {"no error", "unhandled cuda error", "unhandled system error", "internal error",
                                "invalid argument", "invalid usage", "remote process exited or there was a network error",
                                "NCCL operation in progress"};
  return result >= 0 && result < 8 ? names[result] : "unknown result code";
}
const char *ncclGetLastError(void *comm) { (void)comm; return g_last_error; }

int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *comm, void *stream) {
  (void)stream; return enqueue_(ALLREDUCE, s, r, n, dt, op, -1, comm);
}
int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, void *comm, void *stream) {
  (void)stream; return enqueue_(BROADCAST, s, r, n, dt, 0, root, comm);
}
int ncclReduce(const void *s, void *r, size_t n, int dt, int op, int root, void *comm, void *stream) {
  (void)stream; return enqueue_(REDUCE, s, r, n, dt, op, root, comm);
}
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *comm, void *stream) {
  (void)stream; return enqueue_(ALLGATHER, s, r, n, dt, 0, -1, comm);
}
int ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, void *comm, void *stream) {
  (void)stream; return enqueue_(REDUCESCATTER, s, r, n, dt, op, -1, comm);
}
int ncclSend(const void *s, size_t n, int dt, int peer, void *comm, void *stream) {
  (void)stream; return enqueue_(SEND, s, NULL, n, dt, 0, peer, comm);
}
int ncclRecv(void *r, size_t n, int dt, int peer, void *comm, void *stream) {
  (void)stream; return enqueue_(RECV, NULL, r, n, dt, 0, peer, comm);
}

int ncclGroupStart(void) { g_group_depth++; logf_("- -1 ncclGroupStart\n"); return OK; }
int ncclGroupEnd(void) {
  if (g_group_depth <= 0) return USAGE;
  logf_("- -1 ncclGroupEnd\n");
  if (--g_group_depth > 0) return OK;
  int rc = run_ops(g_group, g_group_len);
  g_group_len = 0;
  return rc;
}
