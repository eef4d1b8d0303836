/* Strict check of a baseline JPEG before the GPU decodes it (docs/jpeg_decoding.md#damaged-scans).
 *
 * The hardware decoder and libjpeg-turbo (Pillow) agree bit for bit on well-formed files, but they
 * recover from damage differently: a bad Huffman code, a scan that runs into a marker early, bytes
 * left over before a marker, a wrong restart marker, a coefficient run past the end of a block, or
 * coefficients so large that libjpeg-turbo's range-limit table wraps instead of clamping. Each of
 * these gives other pixels (or Pillow raises where nvJPEG decodes). This file decodes the
 * entropy-coded data without any IDCT and answers 0 only when none of those paths can be taken, so
 * both decoders see the same coefficients and clamp the same way. Anything unusual is refused
 * (a nonzero reason): the image then goes to Pillow, which costs time and never a pixel.
 *
 * Built by scan_check.py with the host's C compiler into a cache folder, loaded once per process; no
 * dependency beyond libc, libm and pthreads.
 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
  OK = 0,
  E_STRUCTURE = 1,   /* markers, segment lengths, tables missing or malformed */
  E_UNSUPPORTED = 2, /* not one interleaved baseline 8-bit scan (the GPU route takes no other) */
  E_BAD_CODE = 3,    /* a Huffman code that is not in its table */
  E_OVERRUN = 4,     /* a run of zeros or a coefficient past position 63 */
  E_SHORT = 5,       /* the scan needs bits beyond the next marker (libjpeg-turbo fills zeros) */
  E_EXTRA = 6,       /* bytes, or padding bits that are not ones, left before a marker */
  E_RESTART = 7,     /* a missing or out-of-order restart marker */
  E_RANGE = 8,       /* coefficients outside what an 8-bit encoder writes, or an IDCT that would wrap */
};

#define LOOK 10 /* bits looked up at once: most codes, with their extra bits, fit */

typedef struct {
  int16_t value;   /* the coefficient (or DC difference) when `total` is set */
  uint8_t rs;      /* the symbol: run << 4 | size (DC: size) */
  uint8_t codelen; /* 0: the code is longer than LOOK bits */
  uint8_t total;   /* code plus extra bits, when both fit in LOOK bits; else 0 */
} Entry;

typedef struct {
  int defined;
  uint8_t counts[17];
  uint8_t symbols[256];
  int32_t maxcode[18];
  int32_t offset[18];
  Entry fast[1 << LOOK];
} Huffman;

static inline int32_t extend(uint32_t v, int s) { return v < (1u << (s - 1)) ? (int32_t)v - (1 << s) + 1 : (int32_t)v; }

static const uint8_t ZIGZAG[64] = {  /* zigzag index -> natural (row-major) position */
  0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6, 7, 14, 21,
  28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60, 61,
  54, 47, 55, 62, 63};

/* libjpeg-turbo's 8-bit range-limit table clamps IDCT outputs (centred on 0) correctly in [-512, 511]
 * and wraps beyond. Its SIMD IDCT multiplies coefficient by quantizer in 16 bits, and keeps the first
 * (column) pass in 16 bits, scaled by sqrt(8) * 2^PASS1_BITS = 11.3 against the true 1-D IDCT: so
 * |first pass| must stay below 32767 / 11.3 = 2896. The limits below leave margin for the
 * fixed-point rounding. A well-formed 8-bit photo stays far inside all three (its outputs are pixels
 * minus 128 plus quantization error; its first pass is at most about 362). */
#define OUTPUT_LIMIT 500.0f
#define PASS1_LIMIT 2800.0f
#define COEF_LIMIT 16383

/* A scan is split among at most this many threads, each with at least this many bytes of it (fewer
 * bytes per thread cost more in starting threads than they save). */
#define MAX_THREADS 16
#define PARALLEL_MIN_BYTES 16384

static float basis[64][64];  /* basis[natural position][pixel]: the exact 2-D IDCT */
static float column[64][8];  /* column[natural position][row]: the first (column) pass */
static float weight[64];     /* max over pixels of |basis[k][.]| */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_basis(void) {
  const double pi = 3.14159265358979323846;
  for (int v = 0; v < 8; v++)
    for (int u = 0; u < 8; u++) {
      double cu = u ? 1.0 : sqrt(0.5), cv = v ? 1.0 : sqrt(0.5), top = 0;
      for (int y = 0; y < 8; y++) {
        double cy = cos((2 * y + 1) * v * pi / 16);
        column[v * 8 + u][y] = (float)(cv / 2 * cy);
        for (int x = 0; x < 8; x++) {
          double b = 0.25 * cu * cv * cos((2 * x + 1) * u * pi / 16) * cy;
          basis[v * 8 + u][y * 8 + x] = (float)b;
          if (fabs(b) > top) top = fabs(b);
        }
      }
      weight[v * 8 + u] = (float)top;
    }
}

/* The exact IDCT of one block (coefficients already multiplied by their quantizers), and its first
 * pass, against the limits above. Only called for the few blocks the cheap bound does not clear. */
static int block_in_range(const int32_t *pos, const int32_t *val, int nz) {
  float out[64] = {0}, pass1[64] = {0};
  for (int i = 0; i < nz; i++) {
    float f = (float)val[i];
    const float *b = basis[pos[i]], *c = column[pos[i]];
    int u = pos[i] & 7;
    for (int p = 0; p < 64; p++) out[p] += f * b[p];
    for (int y = 0; y < 8; y++) pass1[y * 8 + u] += f * c[y];
  }
  for (int p = 0; p < 64; p++)
    if (fabsf(out[p]) > OUTPUT_LIMIT || fabsf(pass1[p]) > PASS1_LIMIT) return 0;
  return 1;
}

/* Canonical codes as libjpeg-turbo derives them, refusing what it refuses; `dc`: sizes, not run/size. */
static int build_huffman(Huffman *h, int dc) {
  int total = 0;
  for (int l = 1; l <= 16; l++) total += h->counts[l];
  if (total > 256) return E_STRUCTURE;
  int32_t code = 0;
  int k = 0;
  memset(h->fast, 0, sizeof h->fast);
  for (int l = 1; l <= 16; l++) {
    /* libjpeg-turbo refuses a table whose codes of a length fill its code space (no code may be all
     * ones); checked before the codes are laid out, so that the fast table is never overrun. */
    if (code + h->counts[l] >= (1 << l)) return E_STRUCTURE;
    h->offset[l] = k - code;
    for (int i = 0; i < h->counts[l]; i++, k++, code++) {
      if (l > LOOK) continue;
      uint8_t rs = h->symbols[k];
      int s = dc ? rs : rs & 15;
      for (int f = code << (LOOK - l); f < (code + 1) << (LOOK - l); f++) {
        Entry *e = &h->fast[f];
        e->rs = rs;
        e->codelen = (uint8_t)l;
        e->total = 0;
        if (l + s <= LOOK) { /* the extra bits follow the code within the looked-up bits */
          e->total = (uint8_t)(l + s);
          e->value = s ? (int16_t)extend((uint32_t)(f >> (LOOK - l - s)) & ((1u << s) - 1), s) : 0;
        }
      }
    }
    h->maxcode[l] = h->counts[l] ? code - 1 : -1;
    code <<= 1;
  }
  return OK;
}

/* The entropy-coded data between two markers, with stuffed zero bytes removed. */
typedef struct {
  uint8_t *buf; /* unstuffed bytes, then zero padding for the 8-byte loads */
  size_t len;   /* in bytes */
  size_t next;  /* offset in the file of the marker that ends it */
} Segment;

/* Unstuffs from `p` up to the next marker. */
static void segment(const uint8_t *d, size_t n, size_t p, Segment *g) {
  size_t len = 0;
  while (p < n) {
    const uint8_t *ff = memchr(d + p, 0xFF, n - p);
    size_t run = ff ? (size_t)(ff - d) - p : n - p;
    memcpy(g->buf + len, d + p, run);
    len += run;
    p += run;
    if (!ff) break;
    if (p + 1 < n && d[p + 1] == 0x00) {
      g->buf[len++] = 0xFF;
      p += 2;
    } else {
      break; /* a marker */
    }
  }
  memset(g->buf + len, 0, 16);
  g->len = len;
  g->next = p;
}

static inline uint64_t bits_at(const uint8_t *buf, size_t bp) {
  uint64_t w;
  memcpy(&w, buf + (bp >> 3), 8);
  return __builtin_bswap64(w) << (bp & 7); /* at least 57 valid bits at the top */
}

/* One code: its table entry (from the fast table, or built here for a code longer than LOOK bits).
 * codelen 0 in the answer: not a code of this table. */
static inline Entry lookup(const Huffman *h, uint64_t w) {
  Entry e = h->fast[w >> (64 - LOOK)];
  if (e.codelen) return e;
  for (int l = LOOK + 1; l <= 16; l++) {
    int32_t code = (int32_t)(w >> (64 - l));
    if (h->maxcode[l] >= 0 && code <= h->maxcode[l]) {
      e.rs = h->symbols[h->offset[l] + code];
      e.codelen = (uint8_t)l;
      e.total = 0;
      return e;
    }
  }
  return e;
}

typedef struct {
  int id, h, v, tq, td, ta;
} Component;

/* After the last MCU of a restart interval, at bit bp of segment g: only padding ones left in the
 * last byte, then the marker `want` (RSTn, or EOI at the very end of the file). */
static int end_interval(const uint8_t *d, size_t n, const Segment *g, size_t bp, int want) {
  size_t limit = g->len * 8;
  if (bp > limit) return E_SHORT;
  size_t left = limit - bp;
  if (left >= 8) return E_EXTRA;
  if (left && (bits_at(g->buf, bp) >> (64 - left)) != (1u << left) - 1) return E_EXTRA;
  size_t p = g->next;
  if (p + 1 >= n) return E_SHORT; /* the data ends without a marker */
  int m = d[p + 1];
  if (m != want) return (m >= 0xD0 && m <= 0xD7) || want != 0xD9 ? E_RESTART : E_STRUCTURE;
  if (want == 0xD9 && p + 2 != n) return E_STRUCTURE;
  return OK;
}

/* What decoding one block needs: the segment, and per block of an MCU its component's tables. */
typedef struct {
  const uint8_t *buf;
  size_t limit; /* bits in the segment */
  int per_mcu;
  const Huffman *dc[10], *ac[10];
  const uint16_t *q[10];
  int comp[10]; /* component of each block of an MCU */
} Ctx;

typedef struct {
  int32_t diff;            /* the DC difference */
  float ac_bound, ac_total; /* the block's AC coefficients (times quantizers): sum |F| max|basis|, sum |F| */
  int nz;                  /* AC coefficients kept in pos/val (for the exact IDCT) */
} Block;

/* A bit reader held in registers for one block: `word` holds the bits from byte `at` on (at least 57
 * valid), `used` of them consumed. Loading a word per symbol from the bit position instead put a
 * memory load on the chain from one symbol to the next. */
typedef struct {
  const uint8_t *buf;
  size_t at;
  uint64_t word;
  int used;
} Reader;

static inline void reader_at(Reader *rd, const uint8_t *buf, size_t bp) {
  rd->buf = buf, rd->at = bp >> 3, rd->used = (int)(bp & 7);
  uint64_t w;
  memcpy(&w, buf + rd->at, 8);
  rd->word = __builtin_bswap64(w);
}

/* At least 32 unconsumed bits ahead (a code and its extra bits take at most 16 + 16). */
static inline void reader_fill(Reader *rd) {
  if (rd->used > 64 - 32) {
    rd->at += (size_t)(rd->used >> 3);
    rd->used &= 7;
    uint64_t w;
    memcpy(&w, rd->buf + rd->at, 8);
    rd->word = __builtin_bswap64(w);
  }
}

static inline size_t reader_bp(const Reader *rd) { return rd->at * 8 + (size_t)rd->used; }

/* The next symbol's entry (codelen 0: no code of this table), nothing consumed. */
static inline Entry reader_peek(const Reader *rd, const Huffman *h) { return lookup(h, rd->word << rd->used); }

/* Consumes entry e's code and its s extra bits; the value they give. */
static inline int32_t reader_value(Reader *rd, const Entry *e, int s) {
  if (e->total) {
    rd->used += e->total;
    return e->value;
  }
  rd->used += e->codelen;
  if (!s) return 0;
  int32_t v = extend((uint32_t)((rd->word << rd->used) >> (64 - s)), s);
  rd->used += s;
  return v;
}

/* One block of MCU position j from bit *bp: everything that does not depend on the DC predictor.
 * Returns 0 or the block's error; *bp moves past it. pos/val receive the AC coefficients. */
static inline int decode_block(const Ctx *cx, int j, size_t *bp, Block *o, int32_t *pos, int32_t *val) {
  const Huffman *ha = cx->ac[j];
  const uint16_t *q = cx->q[j];
  size_t limit = cx->limit;
  Reader rd;
  reader_at(&rd, cx->buf, *bp);
  Entry e = reader_peek(&rd, cx->dc[j]);
  if (!e.codelen) return E_BAD_CODE;
  o->diff = reader_value(&rd, &e, e.rs);
  float bound = 0, total = 0;
  int nz = 0, err = OK;
  for (int k = 1; k < 64; k++) {
    reader_fill(&rd);
    if (reader_bp(&rd) > limit) { /* past the marker: libjpeg-turbo would read zeros */
      err = E_SHORT;
      break;
    }
    e = reader_peek(&rd, ha);
    if (!e.codelen) {
      err = E_BAD_CODE;
      break;
    }
    int r = e.rs >> 4, s = e.rs & 15;
    if (!s) {
      rd.used += e.codelen;
      if (r == 0) break; /* end of block */
      if (r != 15) { /* run/size R/0 for R in 1..14 is undefined (libjpeg-turbo ends the block) */
        err = E_BAD_CODE;
        break;
      }
      k += 15;
      if (k > 63) {
        err = E_OVERRUN;
        break;
      }
      continue;
    }
    k += r;
    if (k > 63 || s > 10) { /* 8-bit AC coefficients have at most 10 bits */
      err = k > 63 ? E_OVERRUN : E_RANGE;
      break;
    }
    int32_t v = reader_value(&rd, &e, s) * q[k];
    if (v > COEF_LIMIT || v < -COEF_LIMIT) {
      err = E_RANGE;
      break;
    }
    bound += fabsf((float)v) * weight[ZIGZAG[k]];
    total += fabsf((float)v);
    pos[nz] = ZIGZAG[k], val[nz++] = v;
  }
  *bp = reader_bp(&rd);
  if (err) return err;
  if (*bp > limit) return E_SHORT;
  o->ac_bound = bound, o->ac_total = total, o->nz = nz;
  return OK;
}

/* The DC-dependent checks of a decoded block, once its predictor is known. pos/val: its AC
 * coefficients, with room for one more. */
/* The cheap bounds, with the DC coefficient times its quantizer `dq` (within COEF_LIMIT):
 * |output| <= sum |F| * max|basis|, |first pass| <= sum |F| / 2. Both checks, the one-thread one and
 * the walk, ask this one function, so they round alike. */
static inline int cheap_bounds_hold(float ac_bound, float ac_total, int32_t dq) {
  float a = fabsf((float)dq);
  return ac_bound + a * weight[0] <= OUTPUT_LIMIT && (ac_total + a) * 0.5f <= PASS1_LIMIT;
}

static inline int block_ok(const Block *o, int32_t pred, int q0, int32_t *pos, int32_t *val) {
  int32_t dq = pred * q0;
  if (dq > COEF_LIMIT || dq < -COEF_LIMIT) return E_RANGE;
  if (cheap_bounds_hold(o->ac_bound, o->ac_total, dq)) return OK; /* the exact IDCT only where they fail */
  pos[o->nz] = 0, val[o->nz] = dq;
  return block_in_range(pos, val, o->nz + 1) ? OK : E_RANGE;
}

/* ---- one segment checked by several threads ----------------------------------------------------
 * Track t decodes from its chunk's first bit as if a block of MCU position 0 began there. Huffman
 * codes resynchronize: soon its block starts are the true ones. Each track records its blocks; then
 * each track goes on into the next chunk until one of its block starts (bit, MCU position) is one the
 * next track recorded: from there both decode the same blocks. The walk follows the true path from
 * the start through the merged records, applying the DC predictors and counting blocks, exactly as
 * the one-thread check does. A track that hits an error before its chunk's end records it and starts
 * again one byte later: if the walk reaches that record, the error is on the true path (decoding from
 * a merge point is the true decoding). A track that never merges simply decodes on to the end. */

typedef struct { /* 20 bytes: a 12 MP scan has about 300k blocks, each recorded once */
  uint32_t bp, end;         /* the block's first bit and the bit after it (scans under 512 MB) */
  float ac_bound, ac_total; /* as in Block */
  int16_t diff;             /* the DC difference (at most 11 bits) */
  uint8_t j;                /* MCU position */
  uint8_t error;            /* 0, or the block's error: the track stops there */
} Rec;

/* A track's records: phase 1's, then those phase 2 adds (a separate list, so that the track before,
 * searching phase 1's records in its own phase 2, never reads a list being grown). */
typedef struct {
  Rec *rec;
  size_t n, cap;
} Recs;

typedef struct Track {
  const Ctx *cx;
  size_t start, stop; /* phase 1: blocks that begin in [start, stop) */
  Recs one, two;      /* records of phase 1 and of phase 2 */
  int speculative;
  const struct Track *next;
  size_t merge_from, merge_to; /* this track's records [0, merge_from), then next's phase-1 records from merge_to */
  int merged, failed;
} Track;

static int push(Recs *l, const Rec *r) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 1024;
    Rec *grown = realloc(l->rec, cap * sizeof(Rec));
    if (!grown) return 0;
    l->rec = grown, l->cap = cap;
  }
  l->rec[l->n++] = *r;
  return 1;
}

static inline const Rec *rec_at(const Track *t, size_t i) {
  return i < t->one.n ? &t->one.rec[i] : &t->two.rec[i - t->one.n];
}

/* Decodes blocks from (bp, j), recording them: in phase 1 those that begin before t->stop, in phase 2
 * until a block start the next track recorded in its phase 1. Stops at an error (recorded). */
static void decode_from(Track *t, size_t bp, int j, int phase2) {
  const Ctx *cx = t->cx;
  int32_t pos[64], val[64];
  const Track *nx = t->next;
  Recs *out = phase2 ? &t->two : &t->one;
  size_t m = 0;
  for (;;) {
    if (phase2) { /* is (bp, j) a block start the next track recorded? */
      while (m < nx->one.n && nx->one.rec[m].bp < bp) m++;
      if (m < nx->one.n && nx->one.rec[m].bp == bp && nx->one.rec[m].j == j) {
        t->merge_from = t->one.n + t->two.n, t->merge_to = m, t->merged = 1;
        return;
      }
    } else if (bp >= t->stop) {
      return;
    }
    Block b = {0, 0, 0, 0};
    Rec r = {(uint32_t)bp, 0, 0, 0, 0, (uint8_t)j, 0};
    int err = decode_block(cx, j, &bp, &b, pos, val);
    r.end = (uint32_t)bp, r.error = (uint8_t)err;
    r.ac_bound = b.ac_bound, r.ac_total = b.ac_total, r.diff = (int16_t)b.diff;
    if (!push(out, &r)) {
      t->failed = 1;
      return;
    }
    if (err) {
      if (!t->speculative || phase2) return;
      /* Perhaps not yet on the true path: start again a byte further on. A merge never crosses an
       * error record (the walk stops at it), so the records stay one sorted list. */
      bp = ((r.bp >> 3) + 1) << 3;
      j = 0;
      if (bp >= t->stop) return;
      continue;
    }
    j = j + 1 == cx->per_mcu ? 0 : j + 1;
  }
}

/* Phase 2 of a track: on from where its phase 1 ended, until it merges into the next track. */
static void track_phase2(Track *t) {
  if (!t->next || t->failed) return;
  size_t n = t->one.n;
  if (n && t->one.rec[n - 1].error) return; /* the walk cannot pass this track's last record */
  decode_from(t, n ? t->one.rec[n - 1].end : t->start, n ? (t->one.rec[n - 1].j + 1) % t->cx->per_mcu : 0, 1);
}

/* ---- a process-wide pool of worker threads ------------------------------------------------------
 * Started on first use and kept (starting a thread per check cost about 0.1 ms each on the GPU
 * machine, as much as a 1024^2 JPEG's share of work). Two kinds of job: a track's phase, which never
 * waits, and a whole check (a batch's image, below), which may wait for its own tracks. A thread
 * waiting for tracks runs queued tracks itself, so no set of checks can hold every thread waiting;
 * it takes no whole check, so waits never nest deeper than one check inside a verdict's wait. */

struct Batch;

typedef struct Job {
  Track *track;
  int phase;           /* 1 or 2: a track's phase; 0: image `index` of `batch`, checked whole */
  int *remaining;      /* phases: the caller's count of unfinished jobs, under pool_lock */
  struct Batch *batch; /* phase 0 */
  int index;
  struct Job *next;
} Job;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER; /* a job was queued */
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER; /* a caller's tracks or a batch's check finished,
                                                             or tracks were queued */
static Job *queue_head, *queue_tail;
static int workers;

static void run_batch_job(Job *job); /* below, with the batches */

static void run_job(Job *job) { /* called without pool_lock */
  if (job->phase == 0) {
    run_batch_job(job);
    return;
  }
  if (job->phase == 1)
    decode_from(job->track, job->track->start, 0, 0);
  else
    track_phase2(job->track);
  pthread_mutex_lock(&pool_lock);
  if (--*job->remaining == 0) pthread_cond_broadcast(&pool_done);
  pthread_mutex_unlock(&pool_lock);
}

/* Takes `job` out of the queue (under pool_lock); 0 if it was not queued. */
static int unlink_job(Job *job) {
  Job *prev = NULL;
  for (Job *j = queue_head; j; prev = j, j = j->next) {
    if (j != job) continue;
    if (prev)
      prev->next = j->next;
    else
      queue_head = j->next;
    if (queue_tail == j) queue_tail = prev;
    return 1;
  }
  return 0;
}

static void mark_running(Job *job); /* below, with the batches */

/* The first queued track, else (unless `tracks_only`) the first queued job (under pool_lock). Tracks
 * first: a large scan's threads are idle workers taking its tracks, not whole checks queued before
 * them. A thread that waits (in run_phase, or for a verdict) takes only tracks: a whole check, which
 * may itself wait, would nest on its stack, and one of another request would hold it past its own. */
static Job *pop_job(int tracks_only) {
  Job *job = queue_head;
  while (job && job->phase == 0) job = job->next;
  if (!job && !tracks_only) job = queue_head;
  if (job) {
    unlink_job(job);
    if (job->phase == 0) mark_running(job);
  }
  return job;
}

static void *worker(void *unused) {
  (void)unused;
  pthread_mutex_lock(&pool_lock);
  for (;;) {
    Job *job = pop_job(0);
    if (!job) {
      pthread_cond_wait(&pool_work, &pool_lock);
      continue;
    }
    pthread_mutex_unlock(&pool_lock);
    run_job(job);
    pthread_mutex_lock(&pool_lock);
  }
  return NULL;
}

/* A child forked while the pool exists has none of its threads, and perhaps a lock held by a thread
 * that is not there: it starts from an empty pool. */
static void pool_prefork(void) { pthread_mutex_lock(&pool_lock); }
static void pool_postfork_parent(void) { pthread_mutex_unlock(&pool_lock); }
static unsigned long generation; /* forks survived: a batch started before one is adopted (below) */
static void pool_postfork_child(void) {
  pthread_mutex_init(&pool_lock, NULL);
  pthread_cond_init(&pool_work, NULL);
  pthread_cond_init(&pool_done, NULL);
  queue_head = queue_tail = NULL;
  workers = 0;
  generation++;
}
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(pool_prefork, pool_postfork_parent, pool_postfork_child); }

/* Wakes idle workers for `jobs` jobs just queued (under pool_lock): one signal each, never more than
 * there are workers. Not a broadcast: a one-image request would wake every idle worker of the pool
 * (up to 16), each waking an idle core, to find one job; a worker takes queued jobs before it waits
 * again, so no job is left without a thread. */
static void wake_workers(int jobs) {
  for (int i = 0; i < jobs && i < workers; i++) pthread_cond_signal(&pool_work);
}

/* Workers up to `wanted` (under pool_lock); how many there are. */
static int grow_pool(int wanted) {
  while (workers < wanted) {
    pthread_t id;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&id, &attr, worker, NULL);
    pthread_attr_destroy(&attr);
    if (failed) break;
    workers++;
  }
  return workers;
}

/* A waiting thread's step (under pool_lock): runs `job` (taken off the queue) without the lock, or,
 * with none, sleeps until a job finishes or tracks are queued. */
static void help_or_wait(Job *job) {
  if (job) {
    pthread_mutex_unlock(&pool_lock);
    run_job(job);
    pthread_mutex_lock(&pool_lock);
  } else {
    pthread_cond_wait(&pool_done, &pool_lock);
  }
}

/* Queues one job per track of tr[first..last) for `phase`, runs `mine` here, and returns once all
 * are done (running queued jobs meanwhile). */
static void run_phase(Track *tr, int first, int last, int phase, Job *jobs, Track *mine) {
  int remaining = last - first;
  pthread_mutex_lock(&pool_lock);
  for (int t = first; t < last; t++) {
    jobs[t] = (Job){&tr[t], phase, &remaining, NULL, 0, NULL};
    if (queue_tail)
      queue_tail->next = &jobs[t];
    else
      queue_head = &jobs[t];
    queue_tail = &jobs[t];
  }
  wake_workers(last - first);
  pthread_cond_broadcast(&pool_done); /* a thread waiting for a verdict helps too (kimi_scan_batch_wait) */
  pthread_mutex_unlock(&pool_lock);
  if (mine) {
    if (phase == 1)
      decode_from(mine, mine->start, 0, 0);
    else
      track_phase2(mine);
  }
  pthread_mutex_lock(&pool_lock);
  while (remaining > 0) help_or_wait(pop_job(1));
  pthread_mutex_unlock(&pool_lock);
}

/* Verdicts the walk gave, and times the threads could not be used: for the tests. */
static long walks, fallbacks;
long kimi_scan_walks(void) { return __atomic_load_n(&walks, __ATOMIC_RELAXED); }
long kimi_scan_fallbacks(void) { return __atomic_load_n(&fallbacks, __ATOMIC_RELAXED); }

/* -1: the threads could not be used (then the one-thread check runs); else the segment's verdict up
 * to its end (the caller checks the end marker at *end_bp). This thread runs track 0. */
static int check_parallel(const Ctx *cx, size_t blocks, int threads, size_t *end_bp) {
  Track tr[MAX_THREADS];
  Job jobs[MAX_THREADS];
  memset(tr, 0, sizeof tr);
  int verdict = -1;
  pthread_once(&fork_once, register_fork);
  pthread_mutex_lock(&pool_lock);
  int have = grow_pool(threads - 1);
  pthread_mutex_unlock(&pool_lock);
  if (have == 0) goto done; /* no thread could be started: the one-thread check decides */
  size_t bytes = cx->limit / 8;
  for (int t = 0; t < threads; t++) {
    tr[t].cx = cx;
    tr[t].start = (bytes * t / threads) * 8;
    tr[t].stop = t + 1 < threads ? (bytes * (t + 1) / threads) * 8 : cx->limit + 1;
    tr[t].speculative = t > 0;
    tr[t].next = t + 1 < threads ? &tr[t + 1] : NULL;
  }
  /* Track 0 here, the others on the pool; phase 2 once every track has finished phase 1 (a track
   * searches the next one's phase-1 records). The last track has no phase 2. */
  run_phase(tr, 1, threads, 1, jobs, &tr[0]);
  run_phase(tr, 1, threads - 1, 2, jobs, &tr[0]);
  for (int t = 0; t < threads; t++)
    if (tr[t].failed) goto done;

  /* The walk. */
  {
    int32_t pred[4] = {0}, pos[64], val[64];
    int t = 0;
    size_t i = 0, bp = 0;
    for (size_t blk = 0; blk < blocks; blk++) {
      while (tr[t].merged && i == tr[t].merge_from) i = tr[t].merge_to, t++;
      if (i >= tr[t].one.n + tr[t].two.n) { /* a track ended without merging or erring: only at the end of the data */
        verdict = E_SHORT;
        goto done;
      }
      const Rec *r = rec_at(&tr[t], i++);
      int j = (int)(blk % (size_t)cx->per_mcu);
      if (r->bp != bp || r->j != j) goto done; /* cannot happen; the one-thread check decides */
      if (r->error) {
        verdict = r->error;
        goto done;
      }
      int c = cx->comp[j];
      pred[c] += r->diff;
      int32_t dq = pred[c] * cx->q[j][0];
      if (dq > COEF_LIMIT || dq < -COEF_LIMIT || !cheap_bounds_hold(r->ac_bound, r->ac_total, dq)) {
        /* block_ok as the one-thread check calls it, with the coefficients decoded once more */
        size_t again = r->bp;
        Block b;
        decode_block(cx, j, &again, &b, pos, val);
        int err = block_ok(&b, pred[c], cx->q[j][0], pos, val);
        if (err) {
          verdict = err;
          goto done;
        }
      }
      bp = r->end;
    }
    *end_bp = bp;
    verdict = OK;
  }
done:
  for (int t = 0; t < threads; t++) free(tr[t].one.rec), free(tr[t].two.rec);
  __atomic_fetch_add(verdict < 0 ? &fallbacks : &walks, 1, __ATOMIC_RELAXED);
  return verdict;
}

static int check_scan(const uint8_t *d, size_t n, size_t p, Segment *g, const Component *comp, int ncomp,
                      const Huffman *dc, const Huffman *ac, uint16_t quant[4][64], size_t mcus, int restart,
                      int threads) {
  Ctx cx;
  cx.per_mcu = 0;
  for (int c = 0; c < ncomp; c++)
    for (int blk = comp[c].h * comp[c].v; blk > 0; blk--) {
      cx.dc[cx.per_mcu] = &dc[comp[c].td], cx.ac[cx.per_mcu] = &ac[comp[c].ta];
      cx.q[cx.per_mcu] = quant[comp[c].tq], cx.comp[cx.per_mcu++] = c;
    }
  int32_t pred[4] = {0}, pos[64], val[64];
  int next_rst = 0;
  size_t bp = 0;
  segment(d, n, p, g);
  cx.buf = g->buf, cx.limit = g->len * 8;
  if (threads < 1) threads = 1;
  if ((size_t)threads > g->len / PARALLEL_MIN_BYTES) threads = (int)(g->len / PARALLEL_MIN_BYTES);
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (!restart && threads > 1 && cx.limit < ((size_t)1 << 32) - 4096) { /* records hold 32-bit positions */
    int verdict = check_parallel(&cx, mcus * (size_t)cx.per_mcu, threads, &bp);
    if (verdict > 0) return verdict;
    if (verdict == OK) return end_interval(d, n, g, bp, 0xD9);
    bp = 0; /* the threads could not be used: one thread */
  }
  for (size_t mcu = 0; mcu < mcus; mcu++) {
    if (restart && mcu && mcu % (size_t)restart == 0) {
      int err = end_interval(d, n, g, bp, 0xD0 + next_rst);
      if (err) return err;
      next_rst = (next_rst + 1) & 7;
      pred[0] = pred[1] = pred[2] = pred[3] = 0;
      segment(d, n, g->next + 2, g);
      cx.limit = g->len * 8;
      bp = 0;
    }
    for (int j = 0; j < cx.per_mcu; j++) {
      Block b;
      int err = decode_block(&cx, j, &bp, &b, pos, val);
      if (!err) err = block_ok(&b, pred[cx.comp[j]] += b.diff, cx.q[j][0], pos, val);
      if (err) return err;
    }
  }
  return end_interval(d, n, g, bp, 0xD9);
}

/* 0 if the scan may go to the GPU, else a reason (the enum above). `threads`: at most this many threads
 * for a large scan. `max_pixels` (0: none): an image larger than this is refused before its scan is
 * read, so that a check started before the request's own size check costs nothing for a bomb. */
int kimi_scan_check(const uint8_t *d, size_t n, int threads, uint64_t max_pixels) {
  pthread_once(&tables_once, build_basis);
  Huffman dc[4], ac[4];
  uint16_t quant[4][64];
  int quant_defined[4] = {0};
  Component comp[4];
  int ncomp = 0, have_frame = 0, restart = 0, built[2][4] = {{0}};
  size_t width = 0, height = 0;
  memset(dc, 0, sizeof dc);
  memset(ac, 0, sizeof ac);
  if (n < 4 || d[0] != 0xFF || d[1] != 0xD8) return E_STRUCTURE;
  size_t p = 2;
  for (;;) { /* header segments up to the one scan */
    if (p + 4 > n || d[p] != 0xFF) return E_STRUCTURE; /* no fill bytes, no stray data */
    int m = d[p + 1];
    size_t len = (size_t)d[p + 2] << 8 | d[p + 3];
    if (len < 2 || p + 2 + len > n) return E_STRUCTURE;
    const uint8_t *s = d + p + 4, *end = d + p + 2 + len;
    p += 2 + len;
    if (m == 0xDB) { /* DQT */
      while (s < end) {
        int pq = *s >> 4, tq = *s & 15;
        if (pq != 0 || tq > 3 || end - s < 65) return pq ? E_UNSUPPORTED : E_STRUCTURE;
        for (int k = 0; k < 64; k++) {
          quant[tq][k] = s[1 + k];
          if (!s[1 + k]) return E_STRUCTURE;
        }
        quant_defined[tq] = 1;
        s += 65;
      }
    } else if (m == 0xC4) { /* DHT */
      while (s < end) {
        int tc = *s >> 4, th = *s & 15;
        if (tc > 1 || th > 3 || end - s < 17) return E_STRUCTURE;
        Huffman *h = tc ? &ac[th] : &dc[th];
        int total = 0;
        for (int l = 1; l <= 16; l++) total += h->counts[l] = s[l];
        if (total > 256 || end - s < 17 + total) return E_STRUCTURE;
        memcpy(h->symbols, s + 17, (size_t)total);
        for (int i = 0; i < total; i++)
          if (tc == 0 && h->symbols[i] > 11) return E_RANGE; /* 8-bit DC differences have at most 11 bits */
        h->defined = 1;
        built[tc][th] = 0; /* (re)built at the scan that uses it */
        s += 17 + total;
      }
    } else if (m == 0xDD) { /* DRI */
      if (len != 4) return E_STRUCTURE;
      restart = s[0] << 8 | s[1];
    } else if (m == 0xC0 || m == 0xC1) { /* SOF0/SOF1: sequential, Huffman */
      if (have_frame || len < 8) return E_STRUCTURE;
      if (s[0] != 8) return E_UNSUPPORTED;
      height = (size_t)s[1] << 8 | s[2];
      width = (size_t)s[3] << 8 | s[4];
      ncomp = s[5];
      if (!width || !height || width > 65500 || height > 65500 || (ncomp != 1 && ncomp != 3))
        return E_UNSUPPORTED; /* libjpeg-turbo refuses sides above JPEG_MAX_DIMENSION */
      if (max_pixels && (uint64_t)width * height > max_pixels) return E_UNSUPPORTED;
      if (len != 8 + 3 * (size_t)ncomp) return E_STRUCTURE;
      for (int c = 0; c < ncomp; c++) {
        comp[c].id = s[6 + 3 * c];
        comp[c].h = s[7 + 3 * c] >> 4;
        comp[c].v = s[7 + 3 * c] & 15;
        comp[c].tq = s[8 + 3 * c];
        if (comp[c].h < 1 || comp[c].h > 4 || comp[c].v < 1 || comp[c].v > 4 || comp[c].tq > 3) return E_STRUCTURE;
      }
      have_frame = 1;
    } else if (m == 0xDA) { /* SOS */
      if (!have_frame || len < 6) return E_STRUCTURE;
      int ns = s[0];
      if (ns != ncomp || len != 6 + 2 * (size_t)ns) return ns != ncomp ? E_UNSUPPORTED : E_STRUCTURE;
      for (int c = 0; c < ns; c++) {
        if (s[1 + 2 * c] != comp[c].id) return E_UNSUPPORTED;
        comp[c].td = s[2 + 2 * c] >> 4;
        comp[c].ta = s[2 + 2 * c] & 15;
        if (comp[c].td > 3 || comp[c].ta > 3 || !dc[comp[c].td].defined || !ac[comp[c].ta].defined ||
            !quant_defined[comp[c].tq])
          return E_STRUCTURE;
      }
      const uint8_t *t = s + 1 + 2 * ns;
      if (t[0] != 0 || t[1] != 63 || t[2] != 0) return E_UNSUPPORTED;
      break;
    } else if ((m >= 0xE0 && m <= 0xEF) || m == 0xFE) { /* APPn, COM: skipped */
    } else {
      return E_UNSUPPORTED; /* progressive, arithmetic, lossless, DNL, ... */
    }
  }

  int hmax = 1, vmax = 1, per_mcu = 0;
  for (int c = 0; c < ncomp; c++) {
    if (comp[c].h > hmax) hmax = comp[c].h;
    if (comp[c].v > vmax) vmax = comp[c].v;
    per_mcu += comp[c].h * comp[c].v;
  }
  size_t mcus;
  if (ncomp == 1) { /* a lone component is one non-interleaved block per MCU, over its own extent */
    size_t cw = (width * comp[0].h + hmax - 1) / hmax, ch = (height * comp[0].v + vmax - 1) / vmax;
    mcus = ((cw + 7) / 8) * ((ch + 7) / 8);
    comp[0].h = comp[0].v = 1;
  } else {
    if (per_mcu > 10) return E_STRUCTURE; /* libjpeg-turbo's limit of blocks per MCU */
    mcus = ((width + 8 * hmax - 1) / (8 * hmax)) * ((height + 8 * vmax - 1) / (8 * vmax));
  }
  for (int c = 0; c < ncomp; c++) {
    int err = built[0][comp[c].td] ? OK : build_huffman(&dc[comp[c].td], 1);
    if (!err) err = built[1][comp[c].ta] ? OK : build_huffman(&ac[comp[c].ta], 0);
    if (err) return err;
    built[0][comp[c].td] = built[1][comp[c].ta] = 1;
  }

  Segment g;
  g.buf = malloc(n - p + 16);
  if (!g.buf) return E_STRUCTURE;
  int err = check_scan(d, n, p, &g, comp, ncomp, dc, ac, quant, mcus, restart, threads);
  free(g.buf);
  return err;
}

/* ---- the checks of several JPEGs, started at once and answered one by one ----------------------
 * A request's checks are queued on the pool with one call and each verdict is asked for when it is
 * needed. Started from Python threads instead, each check needed the GIL to start and to finish, and
 * the thread reading the headers and launching the GPU decode holds it most of that time: the checks
 * of a request's small images then ran after the decode rather than beside it. */

enum { QUEUED = -1, RUNNING = -2, DROPPED = -3 };

typedef struct Batch {
  int n, threads;
  unsigned long generation; /* of the process that queued its checks (see adopt) */
  uint64_t max_pixels;
  const uint8_t **data; /* the caller keeps the bytes alive until kimi_scan_batch_free */
  size_t *len;
  int *code; /* per image: QUEUED, RUNNING, DROPPED or its verdict (under pool_lock) */
  Job *jobs;
} Batch;

static void mark_running(Job *job) { job->batch->code[job->index] = RUNNING; } /* under pool_lock */

/* In a child forked after the batch started, its checks are in no queue and no thread runs them:
 * every unanswered one becomes QUEUED again, which the waiting thread then runs itself (under
 * pool_lock). */
static void adopt(Batch *b) {
  if (b->generation == generation) return;
  for (int i = 0; i < b->n; i++)
    if (b->code[i] == RUNNING) b->code[i] = QUEUED;
  b->generation = generation;
}

static void run_batch_job(Job *job) { /* called without pool_lock, the job marked RUNNING */
  Batch *b = job->batch;
  int i = job->index;
  int code = kimi_scan_check(b->data[i], b->len[i], b->threads, b->max_pixels);
  pthread_mutex_lock(&pool_lock);
  b->code[i] = code; /* the batch may be freed as soon as the lock is let go */
  pthread_cond_broadcast(&pool_done);
  pthread_mutex_unlock(&pool_lock);
}

/* Queues the checks of n JPEGs (as kimi_scan_check(data[i], len[i], threads, max_pixels) would
 * answer them) and returns at once; NULL if out of memory. */
Batch *kimi_scan_batch_start(int n, const uint8_t **data, const size_t *len, int threads, uint64_t max_pixels) {
  if (n < 1) return NULL;
  size_t m = (size_t)n, per_image = sizeof(Job) + sizeof(uint8_t *) + sizeof(size_t) + sizeof(int);
  if (m > (SIZE_MAX - sizeof(Batch)) / per_image) return NULL;
  Batch *b = calloc(1, sizeof *b + m * per_image);
  if (!b) return NULL;
  b->jobs = (Job *)(b + 1); /* Job first: the strictest alignment */
  b->data = (const uint8_t **)(b->jobs + m);
  b->len = (size_t *)(b->data + m);
  b->code = (int *)(b->len + m);
  b->n = n, b->threads = threads < 1 ? 1 : threads, b->max_pixels = max_pixels;
  memcpy(b->data, data, m * sizeof *data);
  memcpy(b->len, len, m * sizeof *len);
  pthread_once(&fork_once, register_fork);
  pthread_mutex_lock(&pool_lock);
  b->generation = generation;
  /* Workers for every image up to `threads` (a thread that waits for a verdict helps too); none at
   * all only if no thread can be started, and then the waiting thread runs the checks itself. */
  grow_pool(b->threads < n ? b->threads : n);
  for (int i = 0; i < n; i++) {
    b->code[i] = QUEUED;
    b->jobs[i] = (Job){NULL, 0, NULL, b, i, NULL};
    if (queue_tail)
      queue_tail->next = &b->jobs[i];
    else
      queue_head = &b->jobs[i];
    queue_tail = &b->jobs[i];
  }
  wake_workers(n);
  pthread_mutex_unlock(&pool_lock);
  return b;
}

/* Image i's verdict, waiting for it: a queued check runs here at once, and while it runs elsewhere
 * this thread runs queued tracks (perhaps that very check's). -3: it was dropped; -4: no image i.
 * Neither this nor kimi_scan_batch_drop/state may run beside kimi_scan_batch_free of the batch. */
int kimi_scan_batch_wait(Batch *b, int i) {
  if (i < 0 || i >= b->n) return -4;
  pthread_mutex_lock(&pool_lock);
  adopt(b);
  for (;;) {
    int code = b->code[i];
    if (code >= 0 || code == DROPPED) {
      pthread_mutex_unlock(&pool_lock);
      return code;
    }
    Job *job = NULL;
    if (code == QUEUED) {
      unlink_job(&b->jobs[i]);
      mark_running(job = &b->jobs[i]);
    } else {
      job = pop_job(1);
    }
    help_or_wait(job);
  }
}

/* Image i's state without waiting: QUEUED (-1), RUNNING (-2), DROPPED (-3), or its verdict. */
int kimi_scan_batch_state(Batch *b, int i) {
  if (i < 0 || i >= b->n) return -4;
  pthread_mutex_lock(&pool_lock);
  adopt(b);
  int code = b->code[i];
  pthread_mutex_unlock(&pool_lock);
  return code;
}

static int drop_locked(Batch *b, int i) { /* under pool_lock: 1 if image i's check will never run */
  if (b->code[i] != QUEUED) return b->code[i] == DROPPED;
  unlink_job(&b->jobs[i]); /* not queued only in a child (adopt) */
  b->code[i] = DROPPED;
  return 1;
}

/* Gives up image i's check if it has not started (its image goes to Pillow whatever it says); 1 if
 * it will never run. */
int kimi_scan_batch_drop(Batch *b, int i) {
  if (i < 0 || i >= b->n) return 0;
  pthread_mutex_lock(&pool_lock);
  adopt(b);
  int dropped = drop_locked(b, i);
  pthread_mutex_unlock(&pool_lock);
  return dropped;
}

/* Drops what has not started and frees the batch if nothing runs (0); else leaves it to be released
 * again later and answers how many checks still run (they read the caller's bytes until then). */
int kimi_scan_batch_release(Batch *b) {
  if (!b) return 0;
  pthread_mutex_lock(&pool_lock);
  adopt(b);
  int running = 0;
  for (int i = 0; i < b->n; i++) {
    drop_locked(b, i);
    running += b->code[i] == RUNNING;
  }
  pthread_mutex_unlock(&pool_lock);
  if (!running) free(b);
  return running;
}

/* Drops what has not started, waits for what runs, and frees the batch. */
void kimi_scan_batch_free(Batch *b) {
  if (!b) return;
  pthread_mutex_lock(&pool_lock);
  adopt(b);
  for (int i = 0; i < b->n; i++) drop_locked(b, i);
  for (int i = 0; i < b->n; i++)
    while (b->code[i] == RUNNING) pthread_cond_wait(&pool_done, &pool_lock);
  pthread_mutex_unlock(&pool_lock);
  free(b);
}
