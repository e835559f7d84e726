// flash_attention.cu with more blocks an SM: the forward 4 (128 registers, 8 bytes spilled), dq 3
// (168, 8 bytes), dk/dv as there (2). ptxas's counts on sm_90.
#define FORWARD_MIN_BLOCKS 4
#define DQ_MIN_BLOCKS 3
#include "flash_attention.cu"
