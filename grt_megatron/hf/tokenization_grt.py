"""The sentencepiece tokenizer of an exported GRT, for `AutoTokenizer` (imports sentencepiece through
transformers' own sentencepiece backend).

transformers' generic sentencepiece backend joins pieces as text, which shows byte-fallback pieces as
`<0x59>`; decoding here goes through sentencepiece itself, so text → ids → text is exact. Sentencepiece
drops control pieces such as `</s>`, so special and added tokens are written out as themselves
(`skip_special_tokens=True` leaves them out), and the text between them is decoded piece run by piece run,
as it was encoded."""

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend


class GRTTokenizer(SentencePieceBackend):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def convert_tokens_to_string(self, tokens):
        text, run = [], []
        for token in tokens:
            if token in self.added_tokens_encoder:
                text += [self.sp_model.decode_pieces(run), token]
                run = []
            else:
                run.append(token)
        return "".join(text) + self.sp_model.decode_pieces(run)
