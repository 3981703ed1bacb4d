"""Adapters that plug pddcore into inference engines (:mod:`.vllm`, :mod:`.sglang`, and
:mod:`.mooncake_compat` for code written against SGLang's mooncake engine wrapper), and what
both use: the control messages' schema (:mod:`._messages`), connections to peer engines
(:mod:`._peers`), the head ranges that move between differing TP sizes (:mod:`._heads`) and
pooled staging buffers (:mod:`._staging`)."""
