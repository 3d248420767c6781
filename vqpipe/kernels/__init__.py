"""The codebook mat-vec and its relatives: the dense rebuild (``dequant``), the fused GPU kernel
(``qmv``, tensor-core variant ``qmv_tc``), the compiled CPU primitive (``ext``). Arrays in, arrays out."""
