// flash_attention_more_blocks.cu with dk/dv at 3 blocks an SM too (168 registers, 436 bytes of
// spill loads). ptxas's counts on sm_90.
#define FORWARD_MIN_BLOCKS 4
#define DQ_MIN_BLOCKS 3
#define DKV_MIN_BLOCKS 3
#include "flash_attention.cu"
