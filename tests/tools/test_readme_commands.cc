// The README's first command (scripts/serve.sh) builds every program its Serve section
// then tells the reader to run: a newcomer's next line must not fail with "No such file".
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "tests/util/catch.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("readme: serve.sh builds every program the Serve section runs from build/", "[docs]") {
  const std::string readme = read_file(std::string(KVFUSE_SOURCE_DIR) + "/README.md");
  const std::string serve = read_file(std::string(KVFUSE_SOURCE_DIR) + "/scripts/serve.sh");
  // The Serve section: from its heading to the next heading of the same level.
  const size_t begin = readme.find("\n## Serve");
  REQUIRE(begin != std::string::npos);
  const size_t end = readme.find("\n## ", begin + 1);
  const std::string section = readme.substr(begin, end == std::string::npos ? std::string::npos : end - begin);

  std::smatch m;
  REQUIRE(std::regex_search(serve, m, std::regex("\ntargets=\"([^\"]*)\"")));
  std::set<std::string> built;
  std::istringstream names(m[1].str());
  for (std::string name; names >> name;) built.insert(name);

  std::set<std::string> called;
  const std::regex program("\\./build/((?:[a-z]+/)*)(kvfuse-[a-z0-9-]+)");
  for (auto it = std::sregex_iterator(section.begin(), section.end(), program); it != std::sregex_iterator(); ++it) {
    called.insert((*it)[2].str());
  }
  REQUIRE(called.count("kvfuse-cli") == 1);  // the section shows how to call the server
  for (const std::string& name : called) {
    INFO(name << " is run in the README's Serve section but scripts/serve.sh does not build it");
    CHECK(built.count(name) == 1);
  }
}
