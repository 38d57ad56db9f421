#include <gtest/gtest.h>

#include "dcr/hash.h"
#include "dcr/relay.h"
#include "test_frames.h"

namespace dcr {
namespace {

using namespace relay_testing;

Result<RelayMessage> RoundTrip(const RelayMessage& m, std::vector<std::string>* storage) {
  *storage = EncodeMessage(m);
  std::vector<std::string_view> views(storage->begin(), storage->end());
  return DecodeMessage(views);
}

TEST(RelayWire, EveryMessageRoundTrips) {
  std::vector<std::string> storage;
  RelayMessage hello;
  hello.type = RelayMessageType::kHello;
  hello.role = RelayRole::kRelay;
  hello.id = "relay-3";
  hello.have = {ObjectKey(1, 0), ObjectKey(1, 1)};
  auto h = RoundTrip(hello, &storage);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->role, RelayRole::kRelay);
  EXPECT_EQ(h->id, "relay-3");
  EXPECT_EQ(h->have, hello.have);

  const std::string data = MakeFrame(0, 7) + MakeFrame(1, 9);
  RelayMessage obj;
  obj.type = RelayMessageType::kObject;
  obj.key = ObjectKey(2, 5);
  obj.size = data.size();
  obj.crc = Crc32c(data.data(), data.size());
  obj.data = data;
  auto o = RoundTrip(obj, &storage);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(storage.size(), 2u);
  EXPECT_EQ(o->key, obj.key);
  EXPECT_EQ(o->data, data);
  EXPECT_TRUE(VerifyFrameObject(*o).ok());

  RelayMessage credit;
  credit.type = RelayMessageType::kCredit;
  credit.credit_bytes = 123456789012;
  credit.credit_objects = 3;
  auto c = RoundTrip(credit, &storage);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->credit_bytes, 123456789012u);
  EXPECT_EQ(c->credit_objects, 3u);

  RelayMessage fence;
  fence.type = RelayMessageType::kFence;
  fence.key = AttemptPrefix(2);
  auto f = RoundTrip(fence, &storage);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->key, fence.key);

  for (const std::string& key : {AttemptPrefix(2), std::string("commits/v0000000002.json")}) {
    RelayMessage notice;
    notice.type = RelayMessageType::kNotice;
    notice.key = key;
    auto n = RoundTrip(notice, &storage);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(n->type, RelayMessageType::kNotice);
    EXPECT_EQ(n->key, key);
  }

  RelayMessage ack;
  ack.type = RelayMessageType::kAck;
  ack.key = AttemptPrefix(2);
  AckRecord good, bad;
  good.receiver = "e0";
  good.digest.lane[0] = 7;
  good.digest.lane[1] = kDigestPrime - 1;
  bad.receiver = "e1";
  bad.ok = false;
  bad.error = std::string(5000, 'x');  // truncated to kRelayMaxAckErrorBytes on the wire
  ack.acks = {good, bad};
  auto a = RoundTrip(ack, &storage);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->key, ack.key);
  ASSERT_EQ(a->acks.size(), 2u);
  EXPECT_EQ(a->acks[0].receiver, "e0");
  EXPECT_TRUE(a->acks[0].ok);
  EXPECT_EQ(a->acks[0].digest, good.digest);
  EXPECT_EQ(a->acks[1].receiver, "e1");
  EXPECT_FALSE(a->acks[1].ok);
  EXPECT_EQ(a->acks[1].error, std::string(kRelayMaxAckErrorBytes, 'x'));

  RelayMessage ping;
  auto p = RoundTrip(ping, &storage);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(storage[0].size(), 8u);  // the header alone
}

TEST(RelayWire, RefusesMalformedMessages) {
  RelayMessage fence;
  fence.type = RelayMessageType::kFence;
  fence.key = AttemptPrefix(2);
  const std::string good = EncodeMessage(fence)[0];
  struct Bad {
    std::string name;
    std::vector<std::string> parts;
    Code code;
  };
  std::string bad_magic = good, newer = good, reserved = good, unknown = good, trailing = good + "x";
  bad_magic[0] ^= 1;
  newer[4] = 2;
  reserved[6] = 1;
  unknown[5] = 42;
  std::vector<Bad> cases = {
      {"no parts", {}, Code::kInvalidArgument},
      {"short header", {good.substr(0, 7)}, Code::kInvalidArgument},
      {"bad magic", {bad_magic}, Code::kInvalidArgument},
      {"newer version", {newer}, Code::kUnimplemented},
      {"reserved bytes", {reserved}, Code::kInvalidArgument},
      {"unknown type", {unknown}, Code::kInvalidArgument},
      {"trailing bytes", {trailing}, Code::kInvalidArgument},
      {"truncated", {good.substr(0, good.size() - 1)}, Code::kInvalidArgument},
      {"extra part", {good, "x"}, Code::kInvalidArgument},
  };
  RelayMessage f2 = fence;
  f2.key = "attempts/v0000000002/../";
  cases.push_back({"fence of no attempt", EncodeMessage(f2), Code::kInvalidArgument});
  RelayMessage obj;
  obj.type = RelayMessageType::kObject;
  obj.key = "snapshots/v0000000000/files/model.safetensors";
  obj.data = "x";
  obj.size = 1;
  cases.push_back({"object that is no frame object", EncodeMessage(obj), Code::kInvalidArgument});
  obj.key = ObjectKey(1, 0);
  obj.size = 2;
  cases.push_back({"object size mismatch", EncodeMessage(obj), Code::kInvalidArgument});
  auto obj_parts = EncodeMessage(obj);
  obj_parts.pop_back();
  cases.push_back({"object without data", obj_parts, Code::kInvalidArgument});
  RelayMessage ack;
  ack.type = RelayMessageType::kAck;
  ack.key = AttemptPrefix(2);
  AckRecord one;
  one.receiver = "e0";
  ack.acks = {one, one};
  cases.push_back({"ack naming a receiver twice", EncodeMessage(ack), Code::kInvalidArgument});
  ack.acks = {one};
  ack.acks[0].digest.lane[1] = kDigestPrime;
  cases.push_back({"ack digest lane not below the prime", EncodeMessage(ack), Code::kInvalidArgument});
  ack.acks[0].digest.lane[1] = 0;
  ack.acks[0].receiver = "";
  cases.push_back({"ack of an empty receiver id", EncodeMessage(ack), Code::kInvalidArgument});
  ack.acks[0].receiver = "e\xff";
  cases.push_back({"ack of a receiver id that is not UTF-8", EncodeMessage(ack), Code::kInvalidArgument});
  ack.acks[0].receiver = "e\x1b[2J";
  cases.push_back({"ack of a receiver id with a control byte", EncodeMessage(ack), Code::kInvalidArgument});
  RelayMessage hello;
  hello.type = RelayMessageType::kHello;
  hello.role = RelayRole::kReceiver;
  for (const char* id : {"", "r\xc3", "r\n1", "\x7f"}) {
    hello.id = id;
    cases.push_back({"hello with a bad id", EncodeMessage(hello), Code::kInvalidArgument});
  }
  ack.acks[0].receiver = "e0";
  std::string bad_ok = EncodeMessage(ack)[0];
  bad_ok[8 + 2 + ack.key.size() + 4 + 2 + 2] = 2;  // header, str16 prefix, u32 count, str16 "e0": the ok byte
  cases.push_back({"ack with ok byte 2", {bad_ok}, Code::kInvalidArgument});
  ack.key = ObjectKey(2, 0);
  cases.push_back({"ack of no attempt prefix", EncodeMessage(ack), Code::kInvalidArgument});
  RelayMessage notice;
  notice.type = RelayMessageType::kNotice;
  for (const char* key : {"", "commits/v0000000002.jso", "commits/v000000002.json", "commits/v00000000x2.json",
                          "commits/v0000000002.json/", "attempts/v0000000002/0000-0123abcd", "receivers/r.json",
                          "attempts/v0000000002/0000-0123abcd/frames/s0-0000.bin", "commits/../receivers/x.json"}) {
    notice.key = key;
    cases.push_back({fmt::format("notice of '{}'", key), EncodeMessage(notice), Code::kInvalidArgument});
  }
  for (const auto& c : cases) {
    std::vector<std::string_view> views(c.parts.begin(), c.parts.end());
    auto m = DecodeMessage(views);
    ASSERT_FALSE(m.ok()) << c.name;
    EXPECT_EQ(m.status().code(), c.code) << c.name << ": " << m.status().ToString();
  }
}

TEST(RelayWire, FrameObjectKeys) {
  EXPECT_EQ(*FrameObjectPrefix(ObjectKey(3, 12)), AttemptPrefix(3));
  EXPECT_EQ(*FrameObjectPrefix(AttemptPrefix(3) + "frames/s2-0012-t7c4096.bin"), AttemptPrefix(3));
  for (const std::string bad :
       {"attempts/v3/0000-ab/frames/s0-0000.bin", "attempts/v0000000003/0000-AB/frames/s0-0000.bin",
        "attempts/v0000000003/0000-ab/frames/s0-0000-t7.bin", "attempts/v0000000003/0000-ab/frames/s0-0000-c7t1.bin",
        "attempts/v0000000003/0000-ab/frames/s0-00.bin", "attempts/v0000000003/0000-ab/manifest.json",
        "attempts/v0000000003/0000-ab/frames/s0-0000.bin/x", "attempts/v0000000003/x-ab/frames/s0-0000.bin", ""})
    EXPECT_FALSE(FrameObjectPrefix(bad).ok()) << bad;
  EXPECT_TRUE(ValidateAttemptPrefix(AttemptPrefix(1)).ok());
  EXPECT_FALSE(ValidateAttemptPrefix("attempts/v0000000001/").ok());
}

TEST(RelayWire, VerificationCatchesEveryKindOfDamage) {
  const std::string data = MakeFrame(0, 1) + MakeFrame(1, 2);
  RelayMessage m;
  m.type = RelayMessageType::kObject;
  m.key = ObjectKey(1, 0);
  m.size = data.size();
  m.crc = Crc32c(data.data(), data.size());
  m.data = data;
  ASSERT_TRUE(VerifyFrameObject(m).ok());

  // Damaged after the sender computed its CRC: the envelope catches it.
  const size_t second = MakeFrame(0, 1).size();  // where the second frame starts
  std::string flipped = data;
  flipped[second / 2] ^= 1;  // the first frame's payload
  RelayMessage d = m;
  d.data = flipped;
  EXPECT_EQ(VerifyFrameObject(d).code(), Code::kDataLoss);
  EXPECT_NE(VerifyFrameObject(d).message().find(m.key), std::string::npos);

  // Damaged before (the CRC covers the damage): the frame's own checksum catches it.
  d.crc = Crc32c(flipped.data(), flipped.size());
  Status s = VerifyFrameObject(d);
  EXPECT_EQ(s.code(), Code::kDataLoss);
  EXPECT_NE(s.message().find("offset 0"), std::string::npos) << s.message();

  // A second frame cut short.
  std::string cut = data.substr(0, data.size() - 5);
  d.data = cut;
  d.size = cut.size();
  d.crc = Crc32c(cut.data(), cut.size());
  s = VerifyFrameObject(d);
  EXPECT_EQ(s.code(), Code::kDataLoss);
  EXPECT_NE(s.message().find("offset " + std::to_string(second)), std::string::npos) << s.message();

  // Empty.
  d.data = {};
  d.size = 0;
  d.crc = 0;
  EXPECT_EQ(VerifyFrameObject(d).code(), Code::kDataLoss);
}

}  // namespace
}  // namespace dcr
