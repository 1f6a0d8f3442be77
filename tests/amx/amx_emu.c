/* A small AMX emulator: the tile instructions microkernels.amx emits, as C functions.
 *
 * microkernels.amx.impl_func(shape, emulate=True) calls tpp_amx_emu_<instruction> instead of
 * the instruction, with the same tile numbers, pointers, strides and configuration bytes, so
 * a host without AMX runs the very same tile program.  Semantics follow the Intel SDM
 * pseudo-code (TILELOADD, TILESTORED, TILEZERO, TDPBUSD, TDPBSSD, TDPBF16PS, LDTILECFG, TILERELEASE);
 * every #GP/#UD condition they list for these operands is counted in `faults` instead.
 */
#include <stdint.h>
#include <string.h>

#define NTILES 8
#define ROWS 16
#define COLSB 64

static uint8_t tiles[NTILES][ROWS][COLSB];
static int rows_of[NTILES], colsb_of[NTILES];
static int configured;
static int64_t faults, configs, releases;

int64_t tpp_amx_emu_faults(void) { return faults; }
int64_t tpp_amx_emu_configs(void) { return configs; }
int64_t tpp_amx_emu_releases(void) { return releases; }
int32_t tpp_amx_emu_configured(void) { return configured; }

void tpp_amx_emu_reset(void) {
  memset(tiles, 0, sizeof(tiles));
  memset(rows_of, 0, sizeof(rows_of));
  memset(colsb_of, 0, sizeof(colsb_of));
  configured = 0;
  faults = configs = releases = 0;
}

static int usable(int t) {
  if (!configured || t < 0 || t >= NTILES || rows_of[t] == 0 || colsb_of[t] == 0) {
    ++faults;
    return 0;
  }
  return 1;
}

int32_t tpp_amx_emu_ldtilecfg(const uint8_t* cfg) {
  int bad = cfg[0] != 1 || cfg[1] != 0;  /* palette 1, start_row 0 */
  for (int i = 2; i < 16; ++i) bad |= cfg[i] != 0;
  for (int i = 32; i < 48; ++i) bad |= cfg[i] != 0;
  for (int i = 56; i < 64; ++i) bad |= cfg[i] != 0;
  for (int t = 0; t < NTILES; ++t) {
    rows_of[t] = cfg[48 + t];
    colsb_of[t] = cfg[16 + 2 * t] | (cfg[17 + 2 * t] << 8);
    bad |= rows_of[t] > ROWS || colsb_of[t] > COLSB || (rows_of[t] == 0) != (colsb_of[t] == 0);
  }
  if (bad) ++faults;
  memset(tiles, 0, sizeof(tiles));
  configured = !bad;
  ++configs;
  return 0;
}

int32_t tpp_amx_emu_tilerelease(void) {
  configured = 0;
  ++releases;
  return 0;
}

int32_t tpp_amx_emu_tileloadd64(int32_t t, const uint8_t* base, int64_t stride) {
  if (!usable(t)) return 0;
  memset(tiles[t], 0, sizeof(tiles[t]));
  for (int r = 0; r < rows_of[t]; ++r) memcpy(tiles[t][r], base + r * stride, colsb_of[t]);
  return 0;
}

int32_t tpp_amx_emu_tilezero(int32_t t) {
  if (!usable(t)) return 0;
  memset(tiles[t], 0, sizeof(tiles[t]));
  return 0;
}

int32_t tpp_amx_emu_tilestored64(int32_t t, uint8_t* base, int64_t stride) {
  if (!usable(t)) return 0;
  for (int r = 0; r < rows_of[t]; ++r) memcpy(base + r * stride, tiles[t][r], colsb_of[t]);
  return 0;
}

/* The shape rules shared by the dot-product instructions. */
static int dp_ok(int c, int a, int b) {
  if (!usable(c) || !usable(a) || !usable(b)) return 0;
  if (c == a || c == b || a == b || rows_of[c] != rows_of[a] || colsb_of[c] != colsb_of[b] ||
      colsb_of[a] != 4 * rows_of[b] || colsb_of[c] % 4 != 0) {
    ++faults;
    return 0;
  }
  return 1;
}

static int32_t int8_dp(int32_t c, int32_t a, int32_t b, int a_signed) {
  if (!dp_ok(c, a, b)) return 0;
  for (int m = 0; m < rows_of[c]; ++m)
    for (int k = 0; k < colsb_of[a] / 4; ++k)
      for (int n = 0; n < colsb_of[c] / 4; ++n) {
        uint32_t acc;
        memcpy(&acc, &tiles[c][m][4 * n], 4);
        for (int i = 0; i < 4; ++i) {
          int32_t x = a_signed ? (int8_t)tiles[a][m][4 * k + i] : tiles[a][m][4 * k + i];
          int32_t y = (int8_t)tiles[b][k][4 * n + i];
          acc += (uint32_t)(x * y);  /* int32 wrap-around, as the hardware */
        }
        memcpy(&tiles[c][m][4 * n], &acc, 4);
      }
  return 0;
}

int32_t tpp_amx_emu_tdpbusd(int32_t c, int32_t a, int32_t b) { return int8_dp(c, a, b, 0); }
int32_t tpp_amx_emu_tdpbssd(int32_t c, int32_t a, int32_t b) { return int8_dp(c, a, b, 1); }

static float bf16(const uint8_t* p) {
  uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

int32_t tpp_amx_emu_tdpbf16ps(int32_t c, int32_t a, int32_t b) {
  if (!dp_ok(c, a, b)) return 0;
  for (int m = 0; m < rows_of[c]; ++m)
    for (int k = 0; k < colsb_of[a] / 4; ++k)
      for (int n = 0; n < colsb_of[c] / 4; ++n) {
        float acc;
        memcpy(&acc, &tiles[c][m][4 * n], 4);
        acc += bf16(&tiles[a][m][4 * k]) * bf16(&tiles[b][k][4 * n]);
        acc += bf16(&tiles[a][m][4 * k + 2]) * bf16(&tiles[b][k][4 * n + 2]);
        memcpy(&tiles[c][m][4 * n], &acc, 4);
      }
  return 0;
}
