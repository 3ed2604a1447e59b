// GetTokenizer's building blocks: CRC-32 and SHA-256 against their published test vectors,
// and the stored zip writer read back entry by entry.
#include "server/tokenizer_bundle.h"
#include "server/zip_writer.h"
#include "tests/util/zip_reader.h"

using namespace kvfuse;
using namespace kvfuse::testing;

TEST_CASE("sglang zip: CRC-32 and SHA-256 give the published check values", "[sglang][zip]") {
  CHECK(server::crc32("123456789") == 0xCBF43926u);
  CHECK(server::crc32("") == 0u);
  // Split input: the running CRC continues.
  CHECK(server::crc32("6789", server::crc32("12345")) == 0xCBF43926u);
  CHECK(server::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(server::sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(server::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("sglang zip: a stored archive reads back with every entry's bytes and CRC", "[sglang][zip]") {
  server::ZipWriter w;
  std::string big(300000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = char((i * 7919) & 0xff);
  REQUIRE(w.add("tokenizer.json", "{\"version\": \"1.0\"}").ok());
  REQUIRE(w.add("empty.txt", "").ok());
  REQUIRE(w.add("tokenizer.model", big).ok());
  auto z = w.finish();
  REQUIRE(z.ok());
  const auto entries = read_stored_zip(*z);
  REQUIRE(entries.size() == 3);
  CHECK(entries.at("tokenizer.json") == "{\"version\": \"1.0\"}");
  CHECK(entries.at("empty.txt").empty());
  CHECK(entries.at("tokenizer.model") == big);
  // The same files make the same bytes (fixed entry times), hence the same SHA-256.
  server::ZipWriter again;
  REQUIRE(again.add("tokenizer.json", "{\"version\": \"1.0\"}").ok());
  REQUIRE(again.add("empty.txt", "").ok());
  REQUIRE(again.add("tokenizer.model", big).ok());
  CHECK(*again.finish() == *z);
  // An empty archive is just the end record.
  CHECK(w.finish()->size() == 22);
}

TEST_CASE("sglang zip: names that would leave the extraction directory are refused", "[sglang][zip]") {
  server::ZipWriter w;
  for (const char* bad : {"", "/etc/passwd", "../up", "a/../../b"}) {
    INFO(bad);
    const absl::Status st = w.add(bad, "x");
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  }
}
