//! sft
