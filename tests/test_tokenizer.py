import kvlib


def test_article_prompt_round_trip():
    tokenizer = kvlib.ToyTokenizer()
    ids = tokenizer.encode("How are you?")
    assert ids == [0, 3, 7, 1, 9]
    assert tokenizer.decode(ids) == "How are you?"
    assert tokenizer.tokens(ids) == ["<bos>", "How", "are", "you", "?"]
    assert tokenizer.vocabulary[5] == "I"
    assert len(tokenizer) == 12 == kvlib.ModelConfig().vocab_size


def test_case_punctuation_and_no_bos():
    tokenizer = kvlib.ToyTokenizer()
    assert tokenizer.encode("how ARE you ?", add_bos=False) == [3, 7, 1, 9]
    assert tokenizer.decode([5, 2, 4, 8, 6, 11, 10, 9]) == "I am fine. thanks and good?"
    every_word = " ".join(tokenizer.words())
    assert sorted(tokenizer.encode(every_word, add_bos=False)) == list(range(1, 12))
