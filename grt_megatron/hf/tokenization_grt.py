"""The sentencepiece tokenizer of an exported GRT, for `AutoTokenizer` (imports sentencepiece through
transformers' own sentencepiece backend).

transformers' generic sentencepiece backend joins pieces as text, which shows byte-fallback pieces as
`<0x59>`; decoding here goes through sentencepiece itself, so text → ids → text is exact."""

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend


class GRTTokenizer(SentencePieceBackend):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def convert_tokens_to_string(self, tokens):
        return self.sp_model.decode_pieces(list(tokens))
