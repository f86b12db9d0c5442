"""ggml's tensor types and llama.cpp's file types, numbered and sized as the gguf package
has them, without importing it (it imports numpy, which `infer list` and `infer info`
need not): tests/test_gguf.py checks these tables against it."""

from enum import IntEnum


class GGMLType(IntEnum):
    """ggml's tensor types (ggml.h `enum ggml_type`; gguf.GGMLQuantizationType): an
    IntEnum, so each equals, and hashes as, the gguf package's member of its value."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


# ggml type -> (values per block, bytes per block): gguf.GGML_QUANT_SIZES
GGML_BLOCKS: dict[GGMLType, tuple[int, int]] = {
    **{GGMLType[t]: (1, size) for t, size in [("F32", 4), ("F16", 2), ("BF16", 2), ("F64", 8)]},
    **{GGMLType[t]: (1, size) for t, size in [("I8", 1), ("I16", 2), ("I32", 4), ("I64", 8)]},
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q5_1: (32, 24),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q8_1: (32, 40),
    GGMLType.Q2_K: (256, 84),
    GGMLType.Q3_K: (256, 110),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210),
    GGMLType.Q8_K: (256, 292),
    GGMLType.IQ2_XXS: (256, 66),
    GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98),
    GGMLType.IQ1_S: (256, 50),
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82),
    GGMLType.IQ4_XS: (256, 136),
    GGMLType.IQ1_M: (256, 56),
    GGMLType.TQ1_0: (256, 54),
    GGMLType.TQ2_0: (256, 66),
    GGMLType.MXFP4: (32, 17),
    GGMLType.NVFP4: (64, 36),
    GGMLType.Q1_0: (128, 18),
}

# general.file_type -> its name (llama.h `enum llama_ftype`; gguf.LlamaFileType).
FILE_TYPES = {
    0: "ALL_F32",
    1: "MOSTLY_F16",
    2: "MOSTLY_Q4_0",
    3: "MOSTLY_Q4_1",
    7: "MOSTLY_Q8_0",
    8: "MOSTLY_Q5_0",
    9: "MOSTLY_Q5_1",
    10: "MOSTLY_Q2_K",
    11: "MOSTLY_Q3_K_S",
    12: "MOSTLY_Q3_K_M",
    13: "MOSTLY_Q3_K_L",
    14: "MOSTLY_Q4_K_S",
    15: "MOSTLY_Q4_K_M",
    16: "MOSTLY_Q5_K_S",
    17: "MOSTLY_Q5_K_M",
    18: "MOSTLY_Q6_K",
    19: "MOSTLY_IQ2_XXS",
    20: "MOSTLY_IQ2_XS",
    21: "MOSTLY_Q2_K_S",
    22: "MOSTLY_IQ3_XS",
    23: "MOSTLY_IQ3_XXS",
    24: "MOSTLY_IQ1_S",
    25: "MOSTLY_IQ4_NL",
    26: "MOSTLY_IQ3_S",
    27: "MOSTLY_IQ3_M",
    28: "MOSTLY_IQ2_S",
    29: "MOSTLY_IQ2_M",
    30: "MOSTLY_IQ4_XS",
    31: "MOSTLY_IQ1_M",
    32: "MOSTLY_BF16",
    36: "MOSTLY_TQ1_0",
    37: "MOSTLY_TQ2_0",
    38: "MOSTLY_MXFP4_MOE",
    39: "MOSTLY_NVFP4",
    40: "MOSTLY_Q1_0",
    1024: "GUESSED",
}
